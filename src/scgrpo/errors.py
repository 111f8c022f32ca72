"""The exceptions for faults in what the user supplied (a file, a folder, settings the GPU cannot hold)."""

from __future__ import annotations


class InputError(ValueError):
    """A fault in something the user supplied (a data file, a model folder, an output folder), with a message that
    names it (and the line or row, where there is one) and says what was expected. ``scgrpo`` prints it as one
    ``scgrpo: error:`` line wherever in a run it is raised (``SCGRPO_DEBUG=1`` shows the traceback instead)."""


def one_line(err: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none)."""
    return " ".join(str(err).split()) or type(err).__name__


def json_fault(err, line: int = 0) -> str:
    """A :class:`json.JSONDecodeError` as "line N: not valid JSON (what at column C)" (``line``: the line of a
    file of one JSON value per line; else the error's own)."""
    return f"line {line or err.lineno}: not valid JSON ({err.msg} at column {err.colno})"


class GPUOutOfMemory(InputError):
    """The GPU ran out of memory in a phase of a step (see :mod:`scgrpo.oom`): the settings ask for more memory than
    the card has free, so it ends the run in one line naming the phase and the setting to change."""
