"""Where the commands print: results on stdout through ``out_console``, everything else
(progress, the run directory, warnings, errors) on stderr through ``err_console``.

Both print text as it is: no Rich markup and no emoji codes, so that a name or a path of
the user's (a task ``[bold]``, a label ``:x:``, a directory ``runs/[a]``) is shown, not
interpreted, and cannot break a table. A style is given as a ``Text`` (:func:`labelled`).
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

#: what a command produces: its tables and findings
out_console = Console(markup=False, emoji=False)
#: progress, notes, warnings and errors: stdout is kept for what a command produces
err_console = Console(stderr=True, markup=False, emoji=False)


def labelled(label: str, style: str, message: str) -> Text:
    """``label`` in ``style``, then ``message`` as it is (``error: ...``, ``warning: ...``)."""
    return Text.assemble((label, style), " ", message)


def notify(message: str) -> None:
    """A library's note for the user on stderr, a ``warning: `` one labelled as such (what
    ``fedloom eval`` and ``fedloom generate`` pass as their ``notify``)."""
    if message.startswith("warning: "):
        text = labelled("warning:", "bold yellow", message.removeprefix("warning: "))
        err_console.print(text, highlight=False, soft_wrap=True)
    else:
        err_console.print(message, highlight=False, soft_wrap=True)
