"""The `mini` family: our own small models (trained here on generated faces), the demo and the test bed."""
