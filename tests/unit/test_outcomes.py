"""The outcome strings the claim and action functions answer are decoded in
db/ into enums (issue 29): each string the SQL can answer is a member, and a
string that is not one fails at decode rather than compare unequal later."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from switchboard_server.db import claims, todo_actions
from switchboard_server.model import ActionOutcome, ClaimOutcome

FUNCTIONS = Path(claims.__file__).parent / "functions"


def _body(file: str, function: str) -> str:
    """The text of one ``CREATE OR REPLACE FUNCTION`` of a functions file."""
    text = (FUNCTIONS / file).read_text()
    start = text.index(f"CREATE OR REPLACE FUNCTION {function}(")
    end = text.index("\n$$;", start)
    return text[start:end]


def test_each_outcome_sb_claim_answers_is_a_claim_outcome() -> None:
    body = _body("fn_claim.sql", "sb_claim")
    answered = set(re.findall(r"RETURN QUERY SELECT '(\w+)'::text", body))
    assert answered == {o.value for o in ClaimOutcome}


def test_each_outcome_sb_cancel_and_sb_requeue_answer_is_an_action_outcome() -> None:
    answered: set[str] = set()
    for function in ("sb_cancel", "sb_requeue"):
        body = _body("fn_actions.sql", function)
        answered |= set(re.findall(r"RETURN QUERY SELECT v_ords\[k\], '(\w+)'::text", body))
        # The refused items' outcomes, named by the call (sb_refused_items' last two
        # arguments) or by sb_refused_items itself.
        for call in re.findall(r"sb_refused_items\(([^;]*?)\) AS r", body, re.S):
            answered |= set(re.findall(r"'(\w+)'", call))
    refused = _body("fn_settle.sql", "sb_refused_items")
    answered |= set(re.findall(r"(?:THEN|ELSE) '(\w+)'", refused))
    assert answered == {o.value for o in ActionOutcome}


def test_an_unknown_outcome_fails_at_decode() -> None:
    with pytest.raises(ValueError, match="'bogus' is not a valid ClaimOutcome"):
        claims._claim_result({"outcome": "bogus", "todo": None, "admission": None})
    with pytest.raises(ValueError, match="'bogus' is not a valid ActionOutcome"):
        todo_actions._acted([{"outcome": "bogus", "todo": None, "was": None}])
    (acted,) = todo_actions._acted([{"outcome": "max_attempts_too_low", "todo": None}])
    assert acted.outcome is ActionOutcome.MAX_ATTEMPTS_TOO_LOW
