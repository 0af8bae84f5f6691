"""Render one resolved job: a file render (file.py) or a live session (live.py), both set up by setup.py and run by
the one chunk loop (pipeline/run.py); summary.py is what either reports when it ends."""

from avatar_cli.render.file import Resume, output_tag, render
from avatar_cli.render.live import run_session
from avatar_cli.render.setup import ModelCache, setup_runtime
from avatar_cli.render.summary import Summary

__all__ = ["ModelCache", "Resume", "Summary", "output_tag", "render", "run_session", "setup_runtime"]
