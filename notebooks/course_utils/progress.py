"""Progress on long work: in a notebook one line that each update replaces and that is gone when the work ends, so
the executed copy keeps the result and not a log of how it got there; elsewhere (a script, a batch log) a line per
update.

    with StatusLine() as status:
        results = run_ladder(settings, echo=status)   # each rung's speed while it runs
    print(ladder_table(results))                       # then the table, once
"""

from __future__ import annotations


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class StatusLine:
    """A callable taking one line of text: shown in place of the last one in a notebook, printed elsewhere."""

    def __init__(self) -> None:
        self._handle = None
        self._notebook = _in_notebook()

    def __call__(self, text: str) -> None:
        if not self._notebook:
            print(text, flush=True)
            return
        from IPython.display import display

        if self._handle is None:  # created empty: a reader that drops updates (nbval) keeps an empty line
            self._handle = display({"text/plain": ""}, raw=True, display_id=True)
        self._handle.update({"text/plain": text}, raw=True)

    @property
    def in_place(self) -> bool:
        """Whether each line replaces the last (a notebook) or is printed after it (a terminal, a batch log)."""
        return self._notebook

    def __enter__(self) -> StatusLine:
        return self

    def __exit__(self, *exc) -> bool:
        if self._handle is not None:  # the work is done (or failed: its error says where): the line goes
            self._handle.update({"text/plain": ""}, raw=True)
        return False
