"""The lmms-eval chat model `vtoken`: any supported model, patched by any vtoken method(s), answering chat tasks.

    lmms-eval --model vtoken --model_args pretrained=vtoken-mini,method=fastervlm,budget=0.25 --tasks ...

Registered through the `lmms_eval.models` entry-point group (see `vtoken.eval.manifests`). Batches are left
padded (right padding gives wrong answers at batch > 1), prompts go through the processor's chat template, and
every sample's visual-token records land in lmms-eval's samples log (`VisualTokenCounts`).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from lmms_eval import utils as lmms_utils
from lmms_eval.api.instance import GenerationResult, Instance
from lmms_eval.api.model import lmms
from lmms_eval.models.model_utils.gen_metrics import log_metrics
from lmms_eval.protocol import ChatMessages
from loguru import logger
from transformers import LogitsProcessor, LogitsProcessorList

from .. import api
from ..counts import llm_input, visual_in_llm
from ..errors import InputError, VTokenError
from ..images import load_image, load_video
from ..zoo import BUILTIN_MODELS, load
from .options import build_methods
from .records import run_means, sample_counts

MODEL_KEYS = ("pretrained", "method", "layout", "device", "dtype", "attn_implementation", "batch_size",
              "max_frames")  # fmt: skip
DTYPES = ("auto", "float32", "float16", "bfloat16")
LAYOUTS = ("native", "official")
# generation kwargs handed to `generate` as they are; `until` is applied to the decoded text
PASSED_GEN_KWARGS = ("top_k", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "min_new_tokens")
DEFAULT_MAX_NEW_TOKENS = 128


class RunAborted(SystemExit):
    """Stops an lmms-eval run with vtoken's message and a non-zero exit status.

    lmms-eval's CLI catches every `Exception` of a run (model construction included) and exits 0, and its own
    model loops turn a failing sample into an empty answer scored 0. A `SystemExit` passes through both.
    `error` is the vtoken (or other) exception that stopped the run.
    """

    def __init__(self, message: str, error: BaseException | None = None):
        super().__init__(f"vtoken: {message}")
        self.error = error


@dataclass
class _Held:
    """The model and processor, out of `lmms.clean()`'s reach (it deletes every `nn.Module` attribute)."""

    model: torch.nn.Module
    processor: Any


class _FirstTokenClock(LogitsProcessor):
    """Notes when the first token's logits exist (after encoding, selection and prefill); changes nothing."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at is None:
            if scores.is_cuda:
                torch.cuda.synchronize(scores.device)
            self.at = time.perf_counter()
        return scores


def _int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit() or int(value) < minimum:
        raise VTokenError(f"model_args {name}={value!r}; expected an integer >= {minimum}")
    return int(value)


class VTokenLMM(lmms):
    """lmms-eval chat model: `pretrained` (built-in name, local directory or hub id) patched with `method`.

    pretrained: vtoken-mini, a tiny-* model, a local checkpoint directory or a hub id.
    method: a registered method, several joined by '+' (stages compose), or none for the unpatched model.
    layout: "native" or "official" (a seed method's own packing, for paper reproduction).
    device, dtype ("auto", "float32", "float16", "bfloat16"), attn_implementation: how the model is loaded.
    batch_size: samples per `generate` (left padded). max_frames: frames sampled from a video file.
    **params: the methods' parameters (`budget=0.25`, `fastv.keep=0.5`; see `vtoken.eval.options`).
    """

    is_simple = False

    def __init__(
        self,
        pretrained: str = "vtoken-mini",
        method: str | None = None,
        layout: str = "native",
        device: str | None = None,
        dtype: str | None = None,
        attn_implementation: str | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,  # lmms-eval passes it; a fixed batch_size is used
        max_frames: int = 8,
        **params: Any,
    ) -> None:
        super().__init__()
        # everything a typo can break is checked before the (slow) model load
        self.batch_size_per_gpu = _int("batch_size", batch_size)
        self.max_frames = _int("max_frames", max_frames)
        if layout not in LAYOUTS:
            raise VTokenError(f"model_args layout={layout!r}; accepted: {', '.join(LAYOUTS)}")
        if dtype is not None and dtype not in DTYPES:
            raise VTokenError(f"model_args dtype={dtype!r}; accepted: {', '.join(DTYPES)}")
        methods = build_methods(method, params, list(MODEL_KEYS))
        self.pretrained, self.method_spec, self.layout = str(pretrained), method, layout

        accelerator = Accelerator()
        if device is None or (accelerator.num_processes > 1 and str(device) == "cuda"):
            device = str(accelerator.device)
        self._device = torch.device(device)
        load_kwargs = {}
        if attn_implementation is not None and self.pretrained not in BUILTIN_MODELS:
            load_kwargs["attn_implementation"] = attn_implementation
        model, processor = load(
            self.pretrained, dtype=None if dtype in (None, "auto") and self.pretrained in BUILTIN_MODELS else dtype,
            device=str(self._device), **load_kwargs
        )  # fmt: skip
        if attn_implementation is not None and self.pretrained in BUILTIN_MODELS:
            model.set_attn_implementation(attn_implementation)
        processor.tokenizer.padding_side = "left"  # right padding answers wrongly at batch > 1
        self._held = _Held(model, processor)
        self.set_methods(methods, layout)

        self.accelerator = accelerator
        self._rank = accelerator.process_index
        self._world_size = accelerator.num_processes
        self._warned: set[str] = set()
        self.timing_inputs = None  # the first batch `generate` saw: what `vtoken eval` times TTFT on

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> VTokenLMM:
        """lmms-eval's constructor path: a bad `--model_args` entry, or a model that cannot be loaded or patched,
        stops the run with the message (lmms-eval would log it and exit 0)."""
        try:
            return super().create_from_arg_string(arg_string, additional_config)
        except VTokenError as err:
            raise RunAborted(str(err), err) from err
        except Exception as err:
            raise RunAborted(f"cannot build the model from --model_args {arg_string!r}: {type(err).__name__}: {err}",
                             err) from err  # fmt: skip

    # ---- what lmms-eval and `vtoken eval` use
    @property
    def model(self) -> torch.nn.Module:
        return self._held.model

    @property
    def processor(self):
        return self._held.processor

    @property
    def tokenizer(self):
        return self._held.processor.tokenizer

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    def set_methods(self, methods: list, layout: str = "native") -> None:
        """Replace the model's patch by `methods` (empty: unpatched); the model itself stays loaded."""
        if api.handle_of(self.model) is not None:
            api.unpatch(self.model)
        if methods:
            api.patch(self.model, methods, layout=layout)

    def clean(self) -> None:
        """Free cached accelerator memory but keep the model: `vtoken eval` evaluates many settings with one load."""
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def loglikelihood(self, requests: list[Instance]):
        raise RunAborted("the vtoken model answers generate_until tasks; loglikelihood tasks are not supported")

    def generate_until_multi_round(self, requests):
        raise RunAborted("the vtoken model answers single-round generate_until tasks; multi-round is not supported")

    # ---- generation
    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        """Answers in batches of `batch_size` (grouped by generation kwargs, in document order)."""
        collator = lmms_utils.Collator(
            [r.args for r in requests], lambda a: (a[4], a[3]), group_fn=lambda a: a[2], grouping=True
        )
        results: list[GenerationResult] = []
        total_tokens, total_seconds = 0, 0.0
        from tqdm import tqdm

        progress = tqdm(total=len(requests), disable=self.rank != 0, desc="vtoken answering")
        for chunk in collator.get_batched(n=self.batch_size, batch_fn=None):
            _, doc_to_messages, gen_kwargs, doc_ids, tasks, splits = zip(*chunk, strict=True)
            try:
                messages = [
                    ChatMessages(messages=fn(self.task_dict[task][split][doc]))
                    for fn, doc, task, split in zip(doc_to_messages, doc_ids, tasks, splits, strict=True)
                ]
                outputs, seconds = self._generate(messages, dict(gen_kwargs[0]))
            except RunAborted:
                raise
            except Exception as err:
                where = f"task {tasks[0]}, doc {', '.join(map(str, doc_ids))}"
                logger.debug("".join(traceback.format_exception(err)))  # shown with --verbosity DEBUG
                raise RunAborted(f"generation failed ({where}): {type(err).__name__}: {err}", err) from err
            results.extend(outputs)
            total_seconds += seconds
            total_tokens += sum(o.token_counts.output_tokens for o in outputs)
            progress.update(len(chunk))
        progress.close()
        results = collator.get_original(results)
        self._log_run(requests, results, total_tokens, total_seconds)
        return results

    def _generate_kwargs(self, gen: dict) -> tuple[dict, list[str]]:
        """HF `generate` kwargs and the `until` strings from an lmms-eval task's generation kwargs."""
        until = gen.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        temperature = float(gen.pop("temperature", 0) or 0)
        top_p = gen.pop("top_p", None)
        gen.pop("do_sample", None)  # sampling follows temperature, as in lmms-eval's own models
        kwargs = {
            "max_new_tokens": int(gen.pop("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
            "num_beams": int(gen.pop("num_beams", 1) or 1),
            "do_sample": temperature > 0,
        }
        if temperature > 0:
            kwargs["temperature"] = temperature
            if top_p is not None:
                kwargs["top_p"] = float(top_p)
        for key in PASSED_GEN_KWARGS:
            if key in gen:
                kwargs[key] = gen.pop(key)
        ignored = sorted(set(gen) - self._warned)
        if ignored:
            self._warned |= set(ignored)
            logger.warning(f"vtoken: generation kwargs {ignored} are not used by HF generate here; ignored")
        return kwargs, [u for u in until if u]

    def _generate(self, messages: list[ChatMessages], gen: dict) -> tuple[list[GenerationResult], float]:
        """One batched `generate` over `messages`; (results with token records, seconds)."""
        processor, model = self.processor, self.model
        kwargs, until = self._generate_kwargs(gen)
        images, videos, texts = [], [], []
        images_per_row, videos_per_row = [], []
        for message in messages:
            for content in (c for m in message.messages for c in m.content if c.type == "video"):
                if content.start_time is not None or content.end_time is not None:  # never decode the wrong span
                    raise InputError("video segments (start_time/end_time) are not supported; the whole file is read")
            row_images, row_videos, audios = message.extract_media()
            if audios:
                raise InputError("vtoken models take images and videos, not audio")
            images.extend(load_image(i) if isinstance(i, str) else i.convert("RGB") for i in row_images)
            for video in row_videos:
                if not isinstance(video, str):
                    raise InputError(f"a video must be a file path; got {type(video).__name__}")
                videos.append(load_video(video, self.max_frames))
            images_per_row.append(len(row_images))
            videos_per_row.append(len(row_videos))
            texts.append(processor.apply_chat_template(message.to_hf_messages(), add_generation_prompt=True))
        visual = {}
        if images:
            visual["images"] = images
        if videos:
            visual["videos"] = videos
        inputs = processor(text=texts, padding=True, return_tensors="pt", **visual).to(self.device)
        for key, value in inputs.items():  # pixels in the model's dtype
            if value.is_floating_point():
                inputs[key] = value.to(model.dtype)

        if self.timing_inputs is None:
            self.timing_inputs = inputs
        clock = _FirstTokenClock()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        with torch.inference_mode(), llm_input(model) as lengths:
            out = model.generate(**inputs, **kwargs, logits_processor=LogitsProcessorList([clock]))
        seconds = time.perf_counter() - start
        handle = api.handle_of(model)
        records = list(handle.records) if handle is not None else []

        prompt_length = inputs["input_ids"].shape[1]
        generated = out[:, prompt_length:]
        decoded = processor.batch_decode(generated, skip_special_tokens=True)
        answers = []
        for text in decoded:
            for stop in until:
                text = text.split(stop, 1)[0]
            answers.append(text)
        counts = sample_counts(
            records,
            images_per_row,
            videos_per_row,
            visual_tokens=self._visual_placeholders(inputs["input_ids"]),
            visual_kept=visual_in_llm(model, inputs, lengths),
            ttft_ms=None if clock.at is None else (clock.at - start) * 1e3,
            input_tokens=inputs["attention_mask"].sum(dim=1).tolist(),
            output_tokens=self._generated_lengths(generated),
        )
        return [GenerationResult(text=a, token_counts=c) for a, c in zip(answers, counts, strict=True)], seconds

    def _visual_placeholders(self, input_ids: torch.Tensor) -> list[int]:
        """Image and video placeholder tokens per row of the prompt."""
        config = self.model.config
        ids = [getattr(config, key, None) for key in ("image_token_id", "image_token_index", "video_token_id",
                                                       "video_token_index")]  # fmt: skip
        ids = sorted({i for i in ids if isinstance(i, int)})
        if not ids:
            return [0] * input_ids.shape[0]
        return torch.isin(input_ids, torch.tensor(ids, device=input_ids.device)).sum(dim=1).tolist()

    def _generated_lengths(self, generated: torch.Tensor) -> list[int]:
        """New tokens per row, up to and including the first end-of-sequence token (the rest is padding)."""
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        lengths = []
        for row in generated.tolist():
            stops = [i for i, token in enumerate(row) if token in eos]
            lengths.append(stops[0] + 1 if stops else len(row))
        return lengths

    def _log_run(self, requests: list[Instance], results: list[GenerationResult], tokens: int, seconds: float):
        """Run-level means into lmms-eval's results JSON (`throughput.avg_vtoken_*`), over every rank's samples
        (rank padding left out)."""
        mine = [
            r.token_counts.to_dict()
            for req, r in zip(requests, results, strict=True)
            if not (req.metadata or {}).get("__padding_only__")
        ]
        if self.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list = [None] * self.world_size
            torch.distributed.all_gather_object(gathered, mine)
            mine = [c for part in gathered for c in part]
        log_metrics(
            total_elapsed_time=seconds,
            total_gen_tokens=tokens,
            avg_speed=tokens / seconds if seconds > 0 else 0.0,
            additional_metrics=run_means(mine),
        )
        self.last_run = mine
