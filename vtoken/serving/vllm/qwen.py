"""Qwen2.5-VL and Qwen3-VL in vLLM: placeholders sized before the encoder, kept tokens at their original M-RoPE
(t, h, w) positions, text after an image continuing where transformers' `get_rope_index` does.

vLLM fixes a request's M-RoPE positions when the request is added, before the encoder runs. vLLM's own pruning
(EVS) corrects them after the encoder through extra embedding channels, a path the CPU model runner never enables
and that continues text after a pruned image at the grid width rather than max(h, w). This plugin does not use
it: positions are the stock ones of the *unpruned* prompt (vLLM's own `get_mrope_input_positions` on the prompt
with every image's run restored), gathered at the kept tokens; a method that hands back a smaller grid (Fourier)
gets the stock positions of that grid. So the kept tokens' indices must be known before the encoder: the method
is dry-run on the grid. A method acting on the encoder's output as placed (DivPrune) picks when the request is
added: the plugin runs the stock encoder on each image or video then, from the request's processed pixels, gathers
the positions at its picks, and keeps the kept embeddings (by pixel content) for `embed_multimodal`, which returns
them without encoding again. Other methods whose picks depend on the features are refused at start on these
families (no [CLS] here: fastervlm, hired, visionzip, vispruner need it anyway; MMTok needs the pre-merger
features). Images are pruned, and Qwen2.5-VL's videos (every frame keeps its budget, as `vtoken.patch` does;
DivPrune: its budget of the whole video); Qwen3-VL's videos pass through unchanged (its prompt puts a timestamp
before every frame, a run per frame that this plugin does not resize yet).

PixelPrune (a tower method) is `vtoken.serving.vllm.tower`: its kept groups follow from the processed pixels, so the
processor sizes the placeholders, the positions are gathered at the kept groups as above, and vLLM's tower runs on
the kept rows (`_process_image_input`); videos pass through unpruned.

Text after a video continues where vLLM's own positions put it: after the video's largest (t, h, w) position, as
the original Qwen2.5-VL code does. transformers 5's `get_rope_index` continues at max(h, w) past the video's
start instead, which differs once the video's time positions reach further (tests use a clip where both agree).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

from vtoken.adapters.families.qwen_vl import same_selection
from vtoken.geometry.kept import output_places
from vtoken.geometry.qwen import item_tokens, resized_grid_thw, run_offsets, token_grid
from vtoken.stages.encoder import EncoderStage
from vtoken.tokens import Selection, VisualTokens

from . import question as questions
from . import tower
from .config import ServingConfig, error, serving_config
from .llava import check_signals_served, why_counts

SIGNALS = {"patch_features", "grid", "resized_grid"}
# of the common signals, the Qwen path fills only the projected tokens (no question, no pre-merger features)
COMMON = {"projected"}


def frames_of(grid: tuple[int, int], frames: int = 1) -> VisualTokens:
    """Zero features of one image (frames=1) or video (a crop per frame) of `grid`: what a dry run selects on."""
    return VisualTokens(torch.zeros(frames, grid[0] * grid[1], 4), grid, {}, torch.zeros(frames, dtype=torch.long))


def select(method, tokens: VisualTokens) -> Selection:
    """The encoder stage's selection of `tokens` (the plugin's Qwen methods read no common signal)."""
    return EncoderStage(method).select(tokens)[0]


def kept_offsets(selection, frames: int, n: int) -> torch.Tensor:
    """[k] kept tokens' offsets in an image's or video's run of frames x n tokens (frame after frame)."""
    return run_offsets(output_places(selection), selection.counts, n)


def plan(method, grid: tuple[int, int], frames: int = 1) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """(kept offsets in the run, smaller grid or None) of one image's grid or one video's frames, decided before
    the encoder (a dry run)."""
    selection = select(method, frames_of(grid, frames))
    return kept_offsets(selection, frames, grid[0] * grid[1]), selection.grid


def data_independent(method, grid: tuple[int, int] = (6, 8)) -> bool:
    """Whether the method keeps the same tokens (or grid) whatever the features: two random draws compared."""
    n = grid[0] * grid[1]
    picks = []
    for seed in (1, 2):
        features = torch.randn(1, n, 4, generator=torch.Generator().manual_seed(seed))
        selection = select(method, VisualTokens(features, grid, {}, torch.zeros(1, dtype=torch.long)))
        picks.append((selection.offsets_of(0).tolist(), selection.grid))
    kept, smaller = plan(method, grid)
    return picks[0] == picks[1] == (kept.tolist(), smaller)


class QwenFamily:
    """Qwen2.5-VL prunes images and videos (every frame keeps its budget, as vtoken.patch on transformers);
    Qwen3-VL images only (its videos carry a timestamp before every frame in the prompt: passed through)."""

    GRID = {"image": "image_grid_thw", "video": "video_grid_thw"}

    def __init__(self, hf_config: Any, name: str):
        self.hf_config, self.name = hf_config, name
        self.merge = hf_config.vision_config.spatial_merge_size
        self.pruned = ("image", "video") if name == "qwen2.5-vl" else ("image",)

    def check(self, config: ServingConfig) -> None:
        tower.check(config, self.name)  # PixelPrune served (images; videos pass through), ToMe refused
        if config.tower is not None:
            if config.layout != "native":
                raise error(f"layout={config.layout!r} is not available for {self.name}; it has: native")
            return
        method = config.method
        check_signals_served(method, SIGNALS, self.name, COMMON)
        if config.layout != "native":
            raise error(f"layout={config.layout!r} is not available for {self.name}; it has: native")
        if method.count_before_encoding(48, (6, 8), 1) is None:
            raise error(
                f"{method.name} ({method!r}) decides its token count on {self.name} from the data; {why_counts()}"
            )
        if not EncoderStage(method).placed and not data_independent(method):
            raise error(
                f"{method.name} picks tokens from the features, but vLLM fixes {self.name}'s M-RoPE positions "
                "before the encoder runs, and kept tokens must keep their original (t, h, w) positions; served "
                "here: methods whose picks follow from the grid (random, pool, fourier), and DivPrune (it picks "
                "among the encoder's output, which the plugin computes when the request is added)"
            )

    def grid(self, grid_thw: torch.Tensor) -> tuple[int, int]:
        return token_grid([int(x) for x in grid_thw.tolist()], self.merge)

    def count(self, method, grid_thw: torch.Tensor) -> int:
        """Placeholders of an image, or of a video (frames x each frame's count; a method acting on the tokens as
        placed, DivPrune: its count of the whole run)."""
        grid = self.grid(grid_thw)
        if EncoderStage(method).placed:
            run = item_tokens([int(x) for x in grid_thw.tolist()], self.merge)
            return method.count_before_encoding(run, (1, run), 1)
        return int(grid_thw[0]) * method.count_before_encoding(grid[0] * grid[1], grid, 1)


def checker(name: str):
    def checked(hf_config: Any) -> ServingConfig | None:
        config = serving_config(hf_config)
        if config is not None:
            QwenFamily(hf_config, name).check(config)
        return config

    return checked


class QwenProcessorMixin(questions.QuestionProcessorMixin):
    family_name = "qwen"

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        from vllm.multimodal.processing import PromptReplacement

        updates = list(super()._get_prompt_updates(mm_items, questions.without_question(hf_processor_mm_kwargs),
                                                   out_mm_kwargs))  # fmt: skip
        hf_config = self.info.get_hf_config()
        config = checker(self.family_name)(hf_config)
        if config is None:
            return updates
        family = QwenFamily(hf_config, self.family_name)
        tokens = {"image": hf_config.image_token_id, "video": hf_config.video_token_id}
        pixel_tower = None
        if config.tower is not None:  # PixelPrune: each image's count from its processed pixels (on the CPU)
            processor = self.info.get_hf_processor().image_processor
            pixel_tower = tower.qwen_input_tower(config.tower, hf_config, self.family_name, processor)

        def replacement(item: int, modality: str):
            data = out_mm_kwargs[modality][item]
            grid_thw = data[family.GRID[modality]].data
            if pixel_tower is not None:
                selected = pixel_tower.select(data["pixel_values"].data, [tower.grid_of(grid_thw)])
                return [tokens[modality]] * selected.counts[0]
            return [tokens[modality]] * family.count(config.method, grid_thw)

        pruned = ("image",) if pixel_tower is not None else family.pruned  # PixelPrune: videos pass through
        return [
            PromptReplacement(modality=u.modality, target=u.target, replacement=partial(replacement,
                                                                                     modality=u.modality))
            if u.modality in pruned else u
            for u in updates
        ]  # fmt: skip


class QwenModelMixin:
    """Mixed in before a vLLM Qwen-VL model class."""

    family_name = "qwen"

    def _vtoken_init(self, vllm_config: Any) -> None:
        self.vtoken = checker(self.family_name)(self.config)
        self.vtoken_family = QwenFamily(self.config, self.family_name)
        self._vtoken_picks: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # pixel key -> [k, D] kept
        self.vtoken_tower = None  # a tower method's `InputTower`
        if self.vtoken is not None and getattr(vllm_config.compilation_config, "cudagraph_mm_encoder", False):
            # vLLM's encoder CUDA graphs run the tower on the stock tables instead of `embed_multimodal`
            raise error(
                f"{self.vtoken.name} on {self.family_name} with compilation_config.cudagraph_mm_encoder=True: vLLM's "
                "encoder CUDA graphs replay the whole-grid tower in place of the model's `embed_multimodal`, so the "
                "placeholders sized for the kept tokens would not match; turn encoder CUDA graphs off"
            )
        if self.vtoken is not None and self.vtoken.tower is not None:
            from vllm.transformers_utils.processor import cached_image_processor_from_config

            if self.use_data_parallel:
                raise error(
                    f"{self.vtoken.tower.name} with mm_encoder_tp_mode='data': vLLM shards the images over the ranks "
                    "and runs its tower through its own data-parallel helper, which takes no kept rows; use the "
                    "default tensor-parallel encoder"
                )
            processor = cached_image_processor_from_config(vllm_config.model_config)
            self.vtoken_tower = tower.qwen_input_tower(self.vtoken.tower, self.config, self.family_name, processor)

    def _vtoken_placed_picks(self, feature: Any) -> torch.Tensor:
        """[k] offsets, in its run, of the tokens a method acting on the placed tokens (DivPrune) keeps of one image
        or video: the stock encoder runs on it when its request is added (M-RoPE positions are fixed then), and its
        kept embeddings wait (by pixel content) for `embed_multimodal`, which returns them without encoding again."""
        modality, family = feature.modality, self.vtoken_family
        pixel_key = "pixel_values" if modality == "image" else "pixel_values_videos"
        grid_key = family.GRID[modality]
        pixels, grid_thw = feature.data[pixel_key].data, feature.data[grid_key].data
        device = next(self.parameters()).device
        kwargs = {pixel_key: pixels.to(device), grid_key: grid_thw[None]}
        if modality == "video" and "second_per_grid_ts" in feature.data:
            kwargs["second_per_grid_ts"] = feature.data["second_per_grid_ts"].data.reshape(1)
        with torch.inference_mode():
            (full,) = super().embed_multimodal(**kwargs)
        width = self.config.text_config.hidden_size
        picks = EncoderStage(self.vtoken.method).select_placed([full[:, :width]])
        placed = torch.arange(len(full), device=full.device) if picks is None else picks.kept[0]
        key = _pixel_key(modality, pixels, grid_thw)
        self._vtoken_picks[key] = full[placed.to(full.device)]
        self._vtoken_picks.move_to_end(key)
        while len(self._vtoken_picks) > PICKS_KEPT:
            self._vtoken_picks.popitem(last=False)
        return placed.cpu()

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        if self.vtoken is None:
            return super().get_mrope_input_positions(input_tokens, mm_features)
        method, family = self.vtoken.method, self.vtoken_family
        placed = EncoderStage(method).placed
        tokens, features, columns, shift, cursor = [], [], [], 0, 0
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            offset, length = feature.mm_position.offset, feature.mm_position.length
            tokens += input_tokens[cursor:offset]
            columns += range(cursor + shift, offset + shift)
            pruned = ("image",) if self.vtoken_tower is not None else family.pruned  # PixelPrune: images only
            if feature.modality not in pruned:  # stock positions
                tokens += input_tokens[offset : offset + length]
                columns += range(offset + shift, offset + length + shift)
                features.append(_moved(feature, offset + shift, length))
            else:
                key = family.GRID[feature.modality]
                grid_thw = feature.data[key].data
                grid, frames = family.grid(grid_thw), int(grid_thw[0])
                if self.vtoken_tower is not None:  # PixelPrune: the kept groups, from the image's pixels
                    pixels = feature.data["pixel_values"].data
                    selected = self.vtoken_tower.select(pixels, [tower.grid_of(grid_thw)])
                    kept, smaller = torch.from_numpy(selected.kept_of(0)), None
                elif placed:  # picks from the encoder's output: encoded now, kept for later
                    kept, smaller = self._vtoken_placed_picks(feature), None
                else:
                    kept, smaller = plan(method, grid, frames)
                if smaller is not None:  # the stock positions of the smaller grid
                    n, kept = frames * smaller[0] * smaller[1], torch.arange(frames * smaller[0] * smaller[1])
                    grid_thw = torch.tensor(resized_grid_thw(frames, smaller, family.merge))
                else:
                    n = frames * grid[0] * grid[1]
                token = input_tokens[offset]
                tokens += [token] * n
                columns += (kept + offset + shift).tolist()
                data = {**feature.data, key: SimpleNamespace(data=grid_thw)}  # videos: second_per_grid_ts too
                features.append(_moved(feature, offset + shift, n, data))
                shift += n - length
            cursor = offset + length
        tokens += input_tokens[cursor:]
        columns += range(cursor + shift, len(input_tokens) + shift)
        positions, _ = super().get_mrope_input_positions(tokens, features)
        positions = positions[:, columns]
        return positions, int(positions.max()) + 1 - len(input_tokens)

    def embed_multimodal(self, **kwargs: object):
        kwargs.pop(questions.FIELD, None)
        if self.vtoken is None or self.vtoken_tower is not None:  # PixelPrune: `_process_image_input`
            return super().embed_multimodal(**kwargs)
        parsed = self._parse_and_validate_multimodal_inputs(**kwargs)
        method, family, index = self.vtoken.method, self.vtoken_family, 0
        placed = EncoderStage(method).placed
        pixel_types = ("pixel_values", "pixel_values_videos")
        stock = [m for m, inputs in parsed.items() if m not in family.pruned or inputs["type"] not in pixel_types]
        if placed and not stock:  # every item was encoded when its request was added
            embeddings = [None] * sum(len(inputs[family.GRID[m]]) for m, inputs in parsed.items())
        else:
            embeddings = list(super().embed_multimodal(**kwargs) or ())
        width = self.config.text_config.hidden_size  # the main features; Qwen3-VL appends DeepStack levels
        for modality, inputs in parsed.items():
            grids = inputs[family.GRID[modality]]
            if modality in stock:
                index += len(grids)
                continue
            pixels = inputs["pixel_values" if modality == "image" else "pixel_values_videos"]
            starts = [0, *torch.cat([g.prod()[None] for g in grids]).cumsum(0).tolist()]
            for item, grid_thw in enumerate(grids):
                grid, frames = family.grid(grid_thw), int(grid_thw[0])
                if placed:  # kept when its request was added, its positions fixed by them
                    key = _pixel_key(modality, pixels[starts[item] : starts[item + 1]], grid_thw)
                    kept = self._vtoken_picks.get(key)
                    if kept is None:
                        raise RuntimeError(
                            f"vtoken: {method.name}'s picks for this {modality} were not made when its request was "
                            "added (its positions depend on them); please report this"
                        )
                    embeddings[index] = kept
                    index += 1
                    continue
                full = embeddings[index]
                per_frame = full[:, :width].reshape(frames, grid[0] * grid[1], width)
                tokens = VisualTokens(per_frame, grid, {}, torch.zeros(frames, dtype=torch.long))
                selection = select(method, tokens)
                planned, smaller = plan(method, grid, frames)
                offsets = kept_offsets(selection, frames, grid[0] * grid[1])
                if smaller != selection.grid or not torch.equal(offsets.cpu(), planned.cpu()):
                    raise RuntimeError(f"vtoken: {method.name} picked tokens other than planned before the encoder")
                embeddings[index] = same_selection(method, selection, tokens, full)
                index += 1
        return tuple(embeddings)

    def _process_image_input(self, image_input: Any) -> tuple[torch.Tensor, ...]:
        """Under a tower method (PixelPrune), every image's kept groups through vLLM's tower, which runs on their
        rows only: per image [kept, D'] (Qwen3-VL: with its DeepStack levels), in ascending group order."""
        if self.vtoken_tower is None or image_input["type"] != "pixel_values":
            return super()._process_image_input(image_input)
        grids = [tower.grid_of(g) for g in image_input["image_grid_thw"]]
        pixels = image_input["pixel_values"]
        selected = self.vtoken_tower.select(pixels, grids)
        features = tower.pruned_tower(self.visual, self.family_name, pixels, grids, selected)
        return features.split(selected.counts)


def _pixel_key(modality: str, pixels: torch.Tensor, grid_thw: torch.Tensor) -> tuple:
    """An image's or video's identity for the picks made when its request was added: its grid and pixel bytes."""
    data = pixels.detach().float().cpu().contiguous().numpy().tobytes()
    return modality, tuple(int(x) for x in grid_thw.tolist()), hashlib.sha1(data).hexdigest()


PICKS_KEPT = 64  # images/videos whose kept embeddings wait for the encoder step (older ones are dropped first)


def _moved(feature: Any, offset: int, length: int, data: Any = None) -> SimpleNamespace:
    """A stand-in of a vLLM `MultiModalFeatureSpec` at another offset (what the stock position code reads)."""
    position = SimpleNamespace(offset=offset, length=length)
    return SimpleNamespace(modality=feature.modality, mm_position=position,
                           data=feature.data if data is None else data)  # fmt: skip


def families() -> dict[str, tuple[type, dict[str, Any], Any]]:
    from vllm.model_executor.models import qwen2_5_vl, qwen3_vl

    class Qwen25VLProcessor(QwenProcessorMixin, qwen2_5_vl.Qwen2_5_VLMultiModalProcessor):
        family_name = "qwen2.5-vl"

    class Qwen25VL(QwenModelMixin, qwen2_5_vl.Qwen2_5_VLForConditionalGeneration):
        family_name = "qwen2.5-vl"

        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._vtoken_init(vllm_config)

    class Qwen3VLProcessor(QwenProcessorMixin, qwen3_vl.Qwen3VLMultiModalProcessor):
        family_name = "qwen3-vl"

    class Qwen3VL(QwenModelMixin, qwen3_vl.Qwen3VLForConditionalGeneration):
        family_name = "qwen3-vl"

        def __init__(self, *, vllm_config, prefix: str = "model") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._vtoken_init(vllm_config)

    return {
        "Qwen2_5_VLForConditionalGeneration": (
            Qwen25VL,
            dict(processor=Qwen25VLProcessor, info=qwen2_5_vl.Qwen2_5_VLProcessingInfo,
                 dummy_inputs=qwen2_5_vl.Qwen2_5_VLDummyInputsBuilder),
            checker("qwen2.5-vl"),
        ),
        "Qwen3VLForConditionalGeneration": (
            Qwen3VL,
            dict(processor=Qwen3VLProcessor, info=qwen3_vl.Qwen3VLProcessingInfo,
                 dummy_inputs=qwen3_vl.Qwen3VLDummyInputsBuilder),
            checker("qwen3-vl"),
        ),
    }  # fmt: skip
