"""The trtllm-pytorch repository in a real Triton, with a stand-in for TensorRT-LLM.

What is under test is ours: `make engines TARGET=trtllm-pytorch`'s configs loading in
Triton (the Python backend running ``tensorrt_llm/1/llmapi.py`` by
``default_model_filename``), the adapter on the tensor contract, the ensemble around
it, streaming, stop words and cancellation. TensorRT-LLM is not on this machine (it
needs a GPU), so a small ``tensorrt_llm`` package plays its LLM API (on PYTHONPATH for
the build, and in the model's version folder, which the Python backend puts on the
stub's ``sys.path``): ``LLM(model=checkpoint)`` greedy-decodes the Hugging Face checkpoint
with transformers and streams it as ``RequestOutput`` does (cumulative token ids, the
end id included, ``abort()``). So the answers must equal transformers' greedy ones,
as the torch engine's do. The real LLM API is exercised by scripts/gpu_smoke.sh.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from serve.engines.triton.requests import AdapterInputs
from serve.generation import GenerateParams
from tests.integration.repositories import repository_with_limits
from tests.integration.test_serve_app import LONG_ANSWER_PROMPT
from tests.integration.test_triton_hosts import collect
from tests.reference import hf_greedy

pytestmark = pytest.mark.integration

STAND_IN = '''
"""A stand-in for TensorRT-LLM's LLM API (tests/integration/test_llmapi_adapter.py)."""
import asyncio

import torch
from transformers import AutoModelForCausalLM

__version__ = "1.4.0"
CALLS = []


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class LLM:
    def __init__(self, model, **options):
        self.options = options
        self.model_dir = model
        self.model = AutoModelForCausalLM.from_pretrained(model, local_files_only=True).eval()
        self.adapters = {}  # lora_int_id -> the base with that adapter, as PEFT loads it

    def generate_async(self, prompt, sampling_params, streaming=False, lora_request=None):
        CALLS.append((prompt, sampling_params, streaming))
        model = self.model
        if lora_request is not None:  # LoRARequest(name, id, path): a PEFT directory
            assert self.options.get("lora_config"), "LoRA without lora_config in LLM()"
            model = self.adapters.get(lora_request.lora_int_id)
            if model is None:
                from peft import PeftModel

                base = AutoModelForCausalLM.from_pretrained(self.model_dir, local_files_only=True)
                model = PeftModel.from_pretrained(base, lora_request.lora_path).eval()
                self.adapters[lora_request.lora_int_id] = model
        return RequestOutput(model, prompt["prompt_token_ids"], sampling_params)

    def shutdown(self):
        pass


class Completion:
    def __init__(self):
        self.token_ids, self.finish_reason, self.logprobs = [], None, None


class RequestOutput:
    def __init__(self, model, ids, params):
        self.model, self.ids, self.params = model, list(ids), params
        self.outputs, self.finished, self.aborted = [Completion()], False, False

    def abort(self):
        self.aborted = True

    async def _steps(self):
        completion = self.outputs[0]
        while not self.aborted:
            with torch.inference_mode():
                logits = self.model(torch.tensor([self.ids + completion.token_ids])).logits
            token = int(logits[0, -1].argmax())
            completion.token_ids = completion.token_ids + [token]
            if token == self.params.end_id:
                completion.finish_reason = "stop"
            elif len(completion.token_ids) >= self.params.max_tokens:
                completion.finish_reason = "length"
            self.finished = completion.finish_reason is not None
            yield self
            if self.finished:
                return
            await asyncio.sleep(0.01)
        completion.finish_reason, self.finished = "cancelled", True
        yield self

    def __aiter__(self):
        return self._steps()

    async def aresult(self):
        async for _ in self._steps():
            pass
        return self
'''

# tensorrt_llm.executor.request.LoRARequest(lora_name, lora_int_id, lora_path).
LORA_REQUEST = """
from dataclasses import dataclass


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str
"""


@pytest.fixture(scope="module")
def llmapi_host(checkpoint_dir, tmp_path_factory):
    site = tmp_path_factory.mktemp("stand-in-site")
    (site / "tensorrt_llm").mkdir()
    (site / "tensorrt_llm" / "__init__.py").write_text(textwrap.dedent(STAND_IN))
    (site / "tensorrt_llm" / "version.py").write_text('__version__ = "1.4.0"\n')
    (site / "tensorrt_llm" / "executor").mkdir()
    (site / "tensorrt_llm" / "executor" / "__init__.py").write_text("")
    (site / "tensorrt_llm" / "executor" / "request.py").write_text(textwrap.dedent(LORA_REQUEST))
    with pytest.MonkeyPatch.context() as patch:
        # The build (a subprocess) finds the stand-in here.
        patch.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        )
        repository = repository_with_limits(
            checkpoint_dir,
            tmp_path_factory.mktemp("llmapi") / "model_repository",
            "--target",
            "trtllm-pytorch",
        )
        import shutil

        from serve.engines.triton.sidecar import SidecarHost

        shutil.copytree(site / "tensorrt_llm", repository / "tensorrt_llm" / "1" / "tensorrt_llm")
        host = SidecarHost(repository).start()
        yield host
        host.stop()


@pytest.mark.parametrize("max_tokens", [3, 40])
def test_answers_equal_greedy_generate_through_the_ensemble(
    llmapi_host, tokenizer, hf_model, max_tokens
):
    chunks = collect(llmapi_host, GenerateParams("Where is the river?", max_tokens))
    expected = hf_greedy(hf_model, tokenizer, "Where is the river?", max_tokens)
    assert "".join(c.text for c in chunks) == tokenizer.decode(expected, skip_special_tokens=True)
    assert chunks[-1].num_output_tokens == len(expected)
    assert chunks[-1].finish_reason == ("length" if len(expected) == max_tokens else "stop")


def test_a_stop_word_ends_the_answer(llmapi_host, tokenizer, hf_model):
    expected = tokenizer.decode(hf_greedy(hf_model, tokenizer, LONG_ANSWER_PROMPT, 40))
    words = expected.split()
    assert len(words) > 3, expected
    # With its leading space: the tokens the word has inside the sentence.
    stop = (" " + words[2],)
    chunks = collect(llmapi_host, GenerateParams(LONG_ANSWER_PROMPT, 40, stop=stop))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and words[2] in text
    assert len(text) < len(expected) and expected.startswith(text.rsplit(words[2], 1)[0])


def test_an_abandoned_stream_frees_the_engine(llmapi_host):
    assert len(collect(llmapi_host, GenerateParams("The cat", 200, min_tokens=200), limit=2)) == 2
    # The next request is answered: the cancelled one did not keep the (one) loop busy.
    chunks = collect(llmapi_host, GenerateParams("The cat", 4))
    assert chunks[-1].finish_reason in ("length", "stop")


def test_an_adapter_sent_once_answers_as_peft_and_then_by_its_id_alone(
    llmapi_host, checkpoint_dir, tokenizer, hf_model, tmp_path
):
    """The contract's LoRA tensors -> a PEFT directory -> the LLM API's LoRARequest (the
    stand-in loads it with PEFT): the answer is PEFT's own greedy one for that adapter."""
    from tests.lora_adapters import SPECS, make_adapter
    from tritonllm.contract import lora_cache_miss

    adapter = make_adapter(checkpoint_dir, SPECS[0], 3, tmp_path / "adapter", task_id=11)
    prompt, max_tokens = "Where is the river?", 12
    expected = hf_greedy(adapter.model, tokenizer, prompt, max_tokens)
    assert expected != hf_greedy(hf_model, tokenizer, prompt, max_tokens)

    def answer(adapter: AdapterInputs | None = None) -> str:
        chunks = collect(llmapi_host, GenerateParams(prompt, max_tokens), adapter=adapter)
        return "".join(c.text for c in chunks)

    with pytest.raises(Exception, match=lora_cache_miss(11)):
        answer(AdapterInputs(11))  # not sent yet: the caller is told to send the weights
    want = tokenizer.decode(expected, skip_special_tokens=True)
    assert answer(AdapterInputs(11, adapter.tensors)) == want
    assert answer(AdapterInputs(11)) == want  # held now: the id alone
    assert answer() == tokenizer.decode(
        hf_greedy(hf_model, tokenizer, prompt, max_tokens), skip_special_tokens=True
    )
