"""The argument parser of the scripts under ``tools/``: argparse, except that a bad argument is
reported on one line (``tool.py: error: KEY: problem``, exit status 2), as the CLI reports a bad
config, without the usage block (``--help`` still prints it)."""

import argparse


class ToolParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")
