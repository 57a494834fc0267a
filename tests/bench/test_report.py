from sparsegen.bench.report import goals


def _row(policy: str, ms: float, **extra) -> dict:
    return {"policy": policy, "context": 8192, "batch": 1, "ms_per_token": ms, **extra}


def test_a_speculative_row_says_its_goal_and_what_its_round_spent():
    """Beside the ratio: the goal at that shape, and the round's parts against a full step (why it pays or not)."""
    rows = [_row("full", 20.0), _row("speculative:streaming:512", 25.0, acceptance_rate=0.84, tokens_per_step=4.19,
                                       rows_per_round=1.0, mean_draft_length=3.8, draft_ms=10.0, verify_ms=60.0,
                                       kv_share=0.8)]
    line = next(line for line in goals(rows) if line.startswith("speculative"))
    assert "0.80x the tokens/s (goal >= 1.5x)" in line
    assert "3.8 draft steps of 10.0 ms (0.50 of a full step) and a verification of 60.0 ms (3.0 full steps)" in line
    rows = [{**row, "context": 4096} for row in rows]  # (no goal there)
    assert "goal" not in next(line for line in goals(rows) if line.startswith("speculative"))
