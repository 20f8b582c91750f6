"""GSM8K scoring: lm-eval's strict-match and flexible-extract filters and its exact_match, on tricky completions."""

import pytest

from minimal_asymloop import gsm8k

ANSWER = "She buys 3 packs of 4 = <<3*4=12>>12 pens, then 1,000 more.\n#### {}"  # GSM8K's answer format

# (completion, reference number, strict-match's string and verdict, flexible-extract's string and verdict)
CASES = [
    ("3 * 4 = 12\n#### 12", "12", "12", True, "12", True),
    ("1,250 dollars in all.\n#### 1,250", "1250", "1,250", True, "1,250", True),  # commas go on both sides
    ("#### 2000", "2,000", "2000", True, "2000", True),
    ("She has $18 left.\n#### $18", "18", "[invalid]", False, "$18", True),  # strict needs a digit after '#### '
    ("#### 18.", "18", "18.", True, "18.", True),  # one trailing period goes
    ("It costs 1,000.", "1000", "[invalid]", False, "1,000.", True),
    ("It is 3 degrees colder: -3\n#### -3", "-3", "-3", True, "-3", True),  # negatives
    ("#### 5.0", "5", "5.0", False, "5.0", False),  # strings compared: 5.0 is not 5
    ("#### 18.00", "18", "18.00", False, "18.00", False),
    ("#### 12\nNo, recheck: 3 * 5\n#### 15", "15", "12", False, "15", True),  # strict: the first ####; flexible: the last
    ("#### 8\n\nQuestion: Tom has 5 apples.\nAnswer: #### 5", "8", "8", True, "8", True),  # cut before 'Question:'
    ("The answer is 4\nQuestion: What is 1 + 2?\nAnswer: #### 3", "4", "[invalid]", False, "4", True),
    ("####5", "5", "[invalid]", False, "5", True),  # strict needs the space
    ("#### 7 apples, so 7", "7", "7", True, "7", True),
    ("I do not know.", "3", "[invalid]", False, "[invalid]", False),
    ("2 then 7 then 11", "11", "[invalid]", False, "11", True),  # single digits: the second alternative
]


@pytest.mark.parametrize("completion,ref,strict,strict_ok,flexible,flexible_ok", CASES)
def test_filters_and_exact_match(completion, ref, strict, strict_ok, flexible, flexible_ok):
    scored = gsm8k.score(completion, ANSWER.format(ref))
    assert scored["strict-match"] == dict(extracted=strict, correct=strict_ok)
    assert scored["flexible-extract"] == dict(extracted=flexible, correct=flexible_ok)


def test_stop_sequences_and_reference():
    assert gsm8k.truncate("x = 1\nQuestion: y</s>") == "x = 1\n" and gsm8k.truncate("a</s>b<|im_end|>") == "a"
    assert gsm8k.final_answer(ANSWER.format("1,000")) == "1,000"
    assert gsm8k.normalize(ANSWER.format("$1,000.")) == "1000"  # the worked solution and the '#### ' go


def test_same_as_lm_eval_itself():
    """Where lm-eval is installed (pip install -e '.[eval]'), its own filters and metric give the same verdicts."""
    extraction = pytest.importorskip("lm_eval.filters.extraction")
    from lm_eval.api.metrics import exact_match_hf_evaluate

    for completion, ref, *_ in CASES:
        text = gsm8k.truncate(completion)
        for name, (regex, group_select) in gsm8k.FILTERS.items():
            theirs = list(extraction.RegexFilter(regex.pattern, group_select).apply([[text]], [None]))[0][0]
            em = exact_match_hf_evaluate([theirs], [ANSWER.format(ref)], regexes_to_ignore=list(gsm8k.IGNORE),
                                         ignore_case=True, ignore_punctuation=False)["exact_match"]
            assert gsm8k.score(completion, ANSWER.format(ref))[name] == dict(extracted=theirs, correct=em == 1.0)
