import pytest

from minimal_asymloop.course.build import passes, yours_or_reference


def _reference(x):
    return 2 * x


def _check(f):
    assert f(3) == 6, f"f(3) = {f(3)}, want 6"


def test_a_right_version_is_kept(capsys):
    def mine(x):
        return x + x

    assert yours_or_reference(mine, _reference, _check) is mine
    assert "yours passes" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [lambda x: x, lambda x: None + x, lambda x: ...])
def test_a_wrong_or_unwritten_version_gets_the_reference_said_in_one_line(wrong, capsys):
    assert yours_or_reference(wrong, _reference, _check, name="double") is _reference
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("double: not right yet (")
    assert "_reference" in out


def test_a_shipped_placeholder_is_called_unwritten_and_a_written_line_is_not(capsys):
    def double(x):
        return ...  # <- write this line

    def written(x):
        return x + 1  # <- write this line: wrong, but written

    assert yours_or_reference(double, _reference, _check) is _reference
    assert capsys.readouterr().out.startswith("double: your line is not written yet")
    assert yours_or_reference(written, _reference, _check) is _reference
    assert capsys.readouterr().out.startswith("written: not right yet (AssertionError: f(3) = 4, want 6)")


def test_a_check_that_rejects_the_reference_is_an_error():
    with pytest.raises(AssertionError):
        yours_or_reference(lambda x: x, lambda x: x + 1, _check)


def test_passes_tells_a_right_version_from_a_wrong_one():
    assert passes(_check, _reference) and not passes(_check, lambda x: x)


def test_a_class_with_an_unwritten_method_is_unwritten():
    class Frozen:
        def append(self, k):
            ...  # <- write this line

    class Written:
        def append(self, k):
            return k  # <- write this line

    from minimal_asymloop.course.build import unwritten

    assert unwritten(Frozen) and not unwritten(Written)


def test_a_placeholder_that_raises_not_implemented_is_unwritten(capsys):
    def my_states(x):
        raise NotImplementedError("my_states is not written yet")

    assert yours_or_reference(my_states, _reference, _check) is _reference
    assert capsys.readouterr().out.startswith("my_states: your line is not written yet")


def test_a_check_cell_run_again_on_the_reference_does_not_say_yours_passes(capsys):
    """A define cell and a check cell apart: after the first run bound the name to the reference, running the check
    cell alone hands in the reference itself. That must not be reported as the reader's version passing."""
    assert yours_or_reference(_reference, _reference, _check, name="double") is _reference
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "still the reference" in out and "yours passes" not in out


def test_an_unwritten_step_prints_one_line_not_its_checks_diagnostics(capsys):
    """A check that prints (notebook 03's resolver check) stays quiet on the placeholder, and a step written below a
    placeholder left in place still counts as written when it passes."""
    def loud(f):
        print(f"diagnostic: f(3) = {f(3)}")
        assert f(3) == 6

    def double(x):
        ...  # <- write this line

    def left_in(x):
        ...  # <- write this line
        return x + x

    assert yours_or_reference(double, _reference, loud) is _reference
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("double: your line is not written yet") and out[1:] == ["diagnostic: f(3) = 6"]
    assert yours_or_reference(left_in, _reference, loud) is left_in
    assert capsys.readouterr().out.splitlines() == ["left_in: yours passes the check; the cells below use it"]
