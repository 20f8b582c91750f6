"""Notebook 03's build of the one-lookup-per-round resolver: the package's answer after r rounds on a small program,
the check of the reader's version against it, and the score of a rule that follows no chain (the plateau's reference)."""

from minimal_asymloop.course.tour import frequency_rule
from minimal_asymloop.tasks import solve


def answer(text: str, rounds: int) -> list:
    """The value of every statement after `rounds` rounds of one lookup each (tasks.solve's value for a statement of
    at most `rounds` hops, None for a longer one): a k-hop statement is resolved in round k."""
    hops = {}
    for stmt in filter(None, text.split(";")):
        lhs, rhs = stmt.split("=")
        hops[lhs] = 1 if rhs.isdigit() else hops[rhs] + 1
    return [v if h <= rounds else None for v, h in zip(solve(text), hops.values())]


def check_rounds(resolve, text: str, rounds=(1, 2, 3)) -> int:
    """Print resolve(text, r) beside the package's answer for each r; return how many statements differ, all r together."""
    wrong = 0
    for r in rounds:
        got, want = resolve(text, r), answer(text, r)
        bad = sum(g != w for g, w in zip(got, want, strict=True))
        wrong += bad
        print(f"{r} round(s): yours {got}, package {want}: {bad} statement(s) differ")
    return wrong


def no_chain_rule(runs) -> dict[int, float]:
    """{hops: accuracy} of notebook 00's no-chain rule (a variable gets the digit assigned most often so far in its
    program) on the runs' check programs: the draw that their curves and stored accuracies are measured on."""
    return frequency_rule(runs.task, n=runs.setting["eval_programs"], seed=1234)
