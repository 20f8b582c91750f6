"""The reader's build steps: a cell ships with the reader's lines unwritten; `yours_or_reference` runs the step's
check on the reader's version and, where it fails or raises, says so in one line and hands back the package's
reference, so that the cells after it run either way (and nbval runs the notebook as committed)."""

import contextlib
import inspect
import io
from collections.abc import Callable


def passes(check: Callable, f) -> bool:
    """Whether `f` passes a build step's check (which raises AssertionError on a wrong version): a notebook shows each
    wrong version failing with it."""
    try:
        check(f)
    except AssertionError:
        return False
    return True


def yours_or_reference(yours, reference, check: Callable, name: str | None = None):
    """`yours` if check(yours) passes (returns without raising), else `reference`, with one printed line that says
    which and why. `check` raises (AssertionError, or any error an unwritten line causes) on a wrong version. The
    reference must pass the same check: a check that fails on it is a bug here, raised, not hidden. While `yours` is
    still marked unwritten (`# <- write`), the check on it runs with its printout suppressed: its diagnostics would
    be the placeholder's."""
    name = name or getattr(yours, "__name__", "your version")
    if yours is reference:  # this cell run again, after an earlier run bound the name to the reference
        print(f"{name}: this is still the reference {reference.__module__}.{reference.__name__}, not yours: run the "
              "cell that defines yours, then this one")
        return reference
    ref = f"{reference.__module__}.{reference.__name__}"
    try:
        if unwritten(yours):  # still marked unwritten: run the check quietly (its diagnostics would be the placeholder's)
            with contextlib.redirect_stdout(io.StringIO()):
                check(yours)
        else:
            check(yours)
    except Exception as e:  # noqa: BLE001 (an unwritten line raises anything: TypeError, AttributeError, ...)
        if isinstance(e, NotImplementedError) or unwritten(yours):  # shipped unwritten: say so, not the placeholder's error
            print(f"{name}: your line is not written yet (`# <- write`), so the cells below use the reference {ref}. "
                  "Write it and run this cell again.")
        else:
            why = f"{type(e).__name__}: {e}".splitlines()[0][:160]
            print(f"{name}: not right yet ({why}); the cells below use the reference {ref}. Fix it and run this cell again.")
        check(reference)  # raises if the check rejects the package's own answer
        return reference
    print(f"{name}: yours passes the check; the cells below use it")
    return yours


def unwritten(obj) -> bool:
    """Whether `obj`'s source still holds a shipped placeholder: a line marked `# <- write` whose code holds `...` or
    ends in `None`. A class: any of its methods (IPython cannot give a class's own source). False where the source
    cannot be read."""
    if inspect.isclass(obj):
        return any(unwritten(f) for f in vars(obj).values() if inspect.isfunction(f))
    try:
        src = inspect.getsource(obj)
    except (OSError, TypeError):
        return False
    for line in src.splitlines():
        code, _, comment = line.partition("#")
        if comment.strip().startswith("<- write") and ("..." in code or code.strip().endswith("None")):
            return True
    return False
