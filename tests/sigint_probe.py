"""Imported by test_cli_shell's Ctrl-C tests: in a spawned worker it records the SIGINT disposition it started with;
imported with PRESS set, it presses Ctrl-C mid-import and swallows the exception, as a gc callback in JAX's import
can ("Exception ignored in: _xla_gc_callback")."""

import os
import signal

AT_IMPORT = signal.getsignal(signal.SIGINT)
if os.environ.get("MTPJAX_TEST_PRESS"):
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:
        pass


def at_import():
    return AT_IMPORT


def main(argv):
    return 0
