"""What an install of avatar holds: every module of the package imports, the ones a command imports only when it
runs included (a broken import there would otherwise surface only in that command)."""

import importlib
import pkgutil

import avatar_cli


def test_every_module_of_the_package_imports():
    names = [info.name for info in pkgutil.walk_packages(avatar_cli.__path__, "avatar_cli.")]
    assert "avatar_cli.cli" in names and "avatar_cli.families.wan_s2v.family" in names
    for name in names:
        importlib.import_module(name)
