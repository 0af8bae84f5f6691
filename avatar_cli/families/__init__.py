"""Model families: one folder each, holding pure nn.Module code with its params dataclasses, the adapters
that map released checkpoints onto it, and what the family tells the pipeline. A family imports nothing of
pipeline/, runtime/, media/ or the CLI."""
