"""``SamplingParams.return_embedding`` / ``LLM.embed``: the embedding is the model's final
hidden state (after the final norm) at the prompt's last token, L2-normalized, whatever the
schedule, chunking, prefix-cache hits or batch around it."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model.testing import build_metadata, make_kv_caches

PROMPTS = [list(range(3, 13)), list(range(40, 110)), list(range(7, 40))]


def _reference(model, prompt: list[int]) -> torch.Tensor:
    """One forward of the whole prompt on a fresh cache: the last row, normalized."""
    block = 16
    pages = -(-len(prompt) // block)
    caches = make_kv_caches(model.arch, pages + 1, block, next(model.parameters()).dtype)
    meta = build_metadata([0], [len(prompt)], [list(range(1, pages + 1))], block)
    with torch.no_grad():
        hidden = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), meta, caches)
    return torch.nn.functional.normalize(hidden[-1].float(), dim=-1)


@pytest.mark.parametrize("options", [
    {"schedule": "chunked", "chunk_size": 16},  # the long prompt in five chunks
    {"schedule": "prefill-first"},
    {"schedule": "disagg"},
    {"schedule": "multiplex", "mux_predictor": "roofline"},
], ids=["chunked16", "prefill_first", "disagg", "multiplex"])
def test_embeddings_are_the_last_tokens_normalized_final_hidden_state(options):
    with LLM("tiny", device="cpu", **options) as llm:
        model = llm.engine.runner.model
        outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            got = torch.tensor(out.outputs.embedding)
            assert out.prompt_token_ids == prompt
            torch.testing.assert_close(got, _reference(model, prompt), atol=1e-5, rtol=1e-4)
        # Again, the prompts' blocks now cached: the same embeddings.
        again = llm.embed([{"prompt_token_ids": p} for p in PROMPTS])
        for first, second in zip(outputs, again, strict=True):
            torch.testing.assert_close(torch.tensor(second.outputs.embedding),
                                       torch.tensor(first.outputs.embedding),
                                       atol=1e-5, rtol=1e-4)


def test_embedding_beside_generations_in_one_batch_and_only_once():
    with LLM("tiny", device="cpu") as llm:
        model = llm.engine.runner.model
        plain = SamplingParams(temperature=0, max_tokens=6)
        both = SamplingParams(temperature=0, max_tokens=6, return_embedding=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [plain, both, plain])
        assert outs[0].embedding is None and outs[2].embedding is None
        # The embedding of its prompt (taken at the first token, not a later step's row),
        # and its tokens those of the same request without it.
        torch.testing.assert_close(torch.tensor(outs[1].embedding),
                                   _reference(model, PROMPTS[1]), atol=1e-5, rtol=1e-4)
        alone = llm.generate({"prompt_token_ids": PROMPTS[1]}, plain)[0]
        assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
        from pdserve.request import Request
        assert Request.num_embedding == 0  # every claim settled: steps skip the pass again


def test_return_embedding_must_be_a_boolean():
    from pdserve.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="return_embedding"):
        SamplingParams(return_embedding="yes")
