"""Quality evaluation: lip sync, identity drift, seams, VAE PSNR and prompt direction on held-out data."""

from avatar_cli.evaluate.bench import evaluate

__all__ = ["evaluate"]
