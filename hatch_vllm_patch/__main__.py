"""``python -m hatch_vllm_patch`` and the ``vllm-patch`` console script.

The command line's modules are imported inside :func:`entry`, so that Ctrl-C while they load
(the first tens of milliseconds) is one line and exit 130 as well, not a traceback.
"""

import sys  # built in, already loaded: nothing runs (and no ``from __future__``, on purpose)


def entry() -> int:
    try:
        _interrupts_from_finalizers_stop_the_command()
        from ._cli import main

        # ``main`` answers a Ctrl-C inside its own ``try`` with what it wrote; one that lands
        # before that ``try`` begins (between the import and it) reaches this handler, and
        # nothing has been written yet. Once the work is done ``main`` ignores Ctrl-C.
        return main(final=True)
    except BaseException as exc:
        # Ctrl-C while a module loads can surface wrapped: a KeyboardInterrupt raised inside
        # ``__set_name__`` becomes a RuntimeError whose cause it is (seen in ipaddress).
        if not interrupted(exc):
            raise
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("vllm-patch: interrupted; nothing was written", file=sys.stderr, flush=True)
        return 130


def _interrupts_from_finalizers_stop_the_command() -> None:
    """A Ctrl-C that lands in a finalizer (an object's ``__del__`` or a ``weakref.finalize``
    callback run by garbage collection) cannot propagate: Python prints "Exception ignored in
    …" with a traceback and carries on. Such a Ctrl-C is delivered again a millisecond later,
    outside the finalizer, where it stops the command with its one line (or is dropped, once
    the work is done and SIGINT is ignored while the result is printed)."""
    import signal

    def again(signum: int, frame: object) -> None:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            raise KeyboardInterrupt

    previous = sys.unraisablehook

    def hook(unraisable: "sys.UnraisableHookArgs") -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # not raised here: this hook runs inside the finalizer's unwinding (a pending
            # signal would be handled within it, and be ignored again)
            signal.setitimer(signal.ITIMER_REAL, 0.001)
            return
        previous(unraisable)

    signal.signal(signal.SIGALRM, again)
    sys.unraisablehook = hook


def interrupted(exc: BaseException) -> bool:
    """Is ``exc`` a Ctrl-C, or an error a Ctrl-C caused (its cause or context chain)?"""
    seen = 0
    cause: BaseException | None = exc
    while cause is not None and seen < 10:
        if isinstance(cause, KeyboardInterrupt):
            return True
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return False


if __name__ == "__main__":
    sys.exit(entry())
