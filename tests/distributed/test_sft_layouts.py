"""Fine-tuning on 4 CPU processes (gloo) against 1 process: FSDP 4 and TP 2 x FSDP 2, each with 2
accumulated micro-batches per step, train the generated conversations (packed, document-masked,
assistant-only loss) like a single process taking the same global batch in one micro-batch: every
step's loss and gradient norm, the held-out loss, and the full final state (parameters, AdamW
moments) within parity.py's tolerances.

Bugs caught: a loss normalised per micro-batch or per rank instead of per trained token of the
global batch (micro-batches and ranks hold different numbers of trained tokens, so the gradients
would differ), rows dealt to ranks other than r, r+W, ... (another global batch), document ids or
positions lost under tensor or sequence parallelism, a held-out loss not summed over ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent

from tests.distributed import sft_worker  # noqa: E402
from tests.support.launch import launch_layout_worker  # noqa: E402
from tests.support.parity import assert_matches_single_process  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch_layout_worker(
        HERE / "sft_worker.py",
        tmp_path_factory.mktemp("sft"),
        {name: name for name in sft_worker.LAYOUTS},
        sft_worker.reference,
        timeout=900,
    )


@pytest.mark.parametrize("layout", list(sft_worker.LAYOUTS))
def test_sft_matches_single_process(results: dict[str, Any], layout: str) -> None:
    single = results["single"][layout]
    assert sorted(single.validation_losses) == [3, 6]
    assert_matches_single_process(results[layout]["run"], single, sft_worker.STEPS, layout)
