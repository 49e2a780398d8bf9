"""The `nemo-dcr` subcommands, one module per purpose; COMMANDS is the registry cli.py builds
its parser from, in the order `nemo-dcr --help` lists them.

  files   diff, patch, stats
  bench   bench codec|placement|overhead|refit|receive|relay|cuda
  store   receive, plan, relay, status, gc, s3-server
  dev     demo, build-kernels, doctor

The command modules are the composition root: only they may import bench/, testing/ and
recipes/, and only inside a function (tests/test_layout.py checks it).
"""

from __future__ import annotations

from nemo_dcr_callback.commands import bench, dev, files, store
from nemo_dcr_callback.commands.base import Command, add_commands

COMMANDS: tuple[Command, ...] = (*files.COMMANDS, bench.COMMAND, *store.COMMANDS, *dev.COMMANDS)

__all__ = ["COMMANDS", "Command", "add_commands"]
