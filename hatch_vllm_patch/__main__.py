"""``python -m hatch_vllm_patch`` and the ``vllm-patch`` console script.

The command line's modules are imported inside :func:`entry`, so that Ctrl-C while they load
(the first tens of milliseconds) is one line and exit 130 as well, not a traceback.
"""

import sys  # built in, already loaded: nothing runs (and no ``from __future__``, on purpose)


def entry() -> int:
    try:
        from ._cli import main
    except KeyboardInterrupt:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("vllm-patch: interrupted; nothing was written", file=sys.stderr, flush=True)
        return 130
    return main(final=True)


if __name__ == "__main__":
    sys.exit(entry())
