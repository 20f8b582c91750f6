"""GSM8K answers scored as lm-evaluation-harness's `gsm8k` task scores them (lm_eval/tasks/gsm8k/gsm8k.yaml, v3.0).

A completion is cut at the first of UNTIL; each filter then takes one string from it; exact_match compares that
string with the reference, GSM8K's whole answer, after the same normalisation on both sides:

- strict-match: the number in the first `#### <number>`;
- flexible-extract: the last number-like run anywhere in the completion;
- exact_match: remove `,`, `$`, everything up to the last `#### ` and a trailing `.`, lower-case, compare the
  strings. So `5.0` is not `5` and `18.00` is not `18`.

The paper says only that it compares "the normalized final numerical answer", so we report both filters, as
lm-eval does.
"""

import re

UNTIL = ("Question:", "</s>", "<|im_end|>")  # generation_kwargs.until: the completion ends before the first of these
FALLBACK = "[invalid]"  # the regex filter's output when nothing matches (never equal to a reference)
FILTERS = {  # name: (regex_pattern, group_select); each is followed by take_first, a no-op for one greedy completion
    "strict-match": (re.compile(r"#### (\-?[0-9\.\,]+)"), 0),
    "flexible-extract": (re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)"), -1),
}
IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")  # exact_match's regexes_to_ignore, applied in this order (ignore_case too)


def final_answer(answer: str) -> str:
    """The reference after GSM8K's last `####`, for display."""
    return answer.rsplit("####", 1)[1].strip()


def truncate(text: str, until=UNTIL) -> str:
    """The completion up to the first stop sequence, as lm-eval cuts a generation."""
    for term in until:
        text = text.split(term)[0]
    return text


def extract(text: str, filter_name: str) -> str:
    """lm-eval's regex filter: the `group_select`-th match (a tuple of groups gives its first non-empty one), stripped."""
    regex, group_select = FILTERS[filter_name]
    found = regex.findall(text)
    if not found:
        return FALLBACK
    match = found[group_select]
    if isinstance(match, tuple):
        match = [m for m in match if m][0]
    return match.strip()


def normalize(text: str) -> str:
    for pattern in IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def score(generated: str, answer: str) -> dict[str, dict]:
    """{filter name: {"extracted": string, "correct": bool}} for one completion against GSM8K's answer."""
    text = truncate(generated)
    out = {}
    for name in FILTERS:
        extracted = extract(text, name)
        out[name] = dict(extracted=extracted, correct=normalize(extracted) == normalize(answer))
    return out
