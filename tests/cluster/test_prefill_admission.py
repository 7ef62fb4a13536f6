"""The prefill admission rule: the server's raising form and the simulator's returning form
decide alike."""

from __future__ import annotations

import pytest

from pdserve.server import protocol as P
from pdserve.server.admission import PrefillAdmission


def _busy(now: list[float]) -> PrefillAdmission:
    admission = PrefillAdmission(clock=lambda: now[0])
    admission.admit(1000, None)
    now[0] = 1.0
    admission.done(1000, 1000, arrival=0.0)  # 1,000 tokens/s measured
    admission.admit(1000, None)  # one prompt ahead of the next
    return admission


def test_try_admit_and_admit_refuse_the_same_prompt_with_the_same_ttft():
    now = [0.0]
    returning, raising = _busy(now), _busy(now)
    assert returning.try_admit(500, ttft_budget_ms=1000.0) == pytest.approx(1500.0)
    with pytest.raises(P.APIError) as err:
        raising.admit(500, ttft_budget_ms=1000.0)
    assert err.value.status == 429 and "1500 ms" in err.value.message
    assert returning.rejected == raising.rejected == 1
    assert returning.queued_tokens == raising.queued_tokens == 1000  # nothing counted in


def test_try_admit_counts_an_accepted_prompt_in():
    now = [0.0]
    admission = _busy(now)
    assert admission.try_admit(500, ttft_budget_ms=2000.0) is None
    assert admission.queued_tokens == 1500 and admission.accepted == 3
    idle = PrefillAdmission(clock=lambda: 0.0)
    assert idle.try_admit(10**6, ttft_budget_ms=1.0) is None  # an idle instance takes any
