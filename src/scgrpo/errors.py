"""The one exception class for faults in what the user supplied."""

from __future__ import annotations


class InputError(ValueError):
    """A fault in something the user supplied (a data file, a model folder, an output folder), with a message that
    names it (and the line or row, where there is one) and says what was expected. ``scgrpo`` prints it as one
    ``scgrpo: error:`` line wherever in a run it is raised (``SCGRPO_DEBUG=1`` shows the traceback instead)."""
