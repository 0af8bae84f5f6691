"""Super-resolution models that work on decoded frames: a layer beside the families (it imports modules and runtime
only), used by the pipeline's super-resolution stage."""
