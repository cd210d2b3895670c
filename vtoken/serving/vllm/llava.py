"""LLaVA-1.5 in vLLM: placeholders sized from the method's count before encoding, kept tokens chosen after it.

Front end (`LlavaProcessor`): each image's placeholder run is `count_before_encoding` of its valid tokens (the
patches outside a pad-to-square border, read from the processed pixels, for methods that exclude it; all N
otherwise). Engine (`Llava.embed_multimodal`): vLLM's CLIP tower (built up to the feature layer) runs once with
[CLS]-row probes on the layers the method reads; the features before the projector become `VisualTokens`, the
method selects, and only the kept tokens are projected, as vtoken's transformers adapter does. ToMe (a tower
method): the placeholders are N - sum r'_l, and the tower merges in its blocks (`vtoken.serving.vllm.tome`).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from vllm.model_executor.models.llava import (
    LlavaForConditionalGeneration,
    LlavaMultiModalProcessor,
    LlavaProcessingInfo,
    _build_llava_or_pixtral_hf_info,
    _build_llava_or_pixtral_hf_processor,
)

from vtoken.adapters.probes import RECEIVED, named_block, tower_signals
from vtoken.geometry.kept import kept_rows
from vtoken.geometry.llava import encoder_layer, outside_pad_border, token_grid
from vtoken.methods.base import TowerMethod, TowerShape
from vtoken.stages.encoder import COMMON_SIGNALS, EncoderStage, SignalSources, check_signals, check_takes
from vtoken.stages.tower import TowerStage
from vtoken.tokens import Selection, TextQuery, VisualTokens

from . import question as questions
from . import tower
from .config import ServingConfig, error, serving_config
from .signals import QKVClsProbe
from .tome import MergingBlocks, llava_shape


class LlavaFamily:
    """What vtoken knows about a LLaVA-1.5 config in vLLM: grid, signals, counts."""

    name = "llava-1.5"

    def __init__(self, hf_config: Any):
        self.hf_config = hf_config
        vision = hf_config.vision_config
        self.side = token_grid(vision.image_size, vision.patch_size)[0]
        self.patch = vision.patch_size
        layer = hf_config.vision_feature_layer
        if isinstance(layer, (list, tuple)):
            raise error("LLaVA with several vision_feature_layer values is not supported (one feature layer)")
        self.num_layers = vision.num_hidden_layers
        layer = encoder_layer(layer, self.num_layers)  # the encoder layer whose output is the feature
        self.feature_layer = -1 if layer is None else layer

    @property
    def grid(self) -> tuple[int, int]:
        return self.side, self.side

    @property
    def has_cls(self) -> bool:
        """A [CLS] token the LLM never sees (LLaVA drops it), scored at any layer up to the feature layer."""
        return self.hf_config.vision_feature_select_strategy == "default" and self.feature_layer >= 0

    def signals(self, method=None) -> set[str]:
        """What the tower serves (`method`: the encoder method whose block aliases, HiPrune's, are resolved)."""
        signals = {"patch_features", "grid", "resized_grid"}
        if self.has_cls:
            signals |= {"cls_attention", "keys"} | {f"cls_attention@{i}" for i in range(self.feature_layer + 1)}
            signals |= {f"cls_attention@{i - self.num_layers}" for i in range(self.feature_layer + 1)}
            # CDPruner's image embeds: the tower is CLIP-L/336's, its final norm the CLIP checkpoint's (vLLM builds
            # the tower up to the feature layer, without it)
            signals.add("clip_features")
            # the attention every token receives, at the feature layer or any block vLLM builds (up to it)
            signals |= {name for name in tower_signals(method, RECEIVED, self.name, self.num_layers)
                        if self.tower_block(method, name) is not None}  # fmt: skip
            signals |= {name for name in tower_signals(method, "cls_attention", self.name, self.num_layers)
                        if self.tower_block(method, name) is not None}  # fmt: skip
        return signals

    def tower_block(self, method, signal: str) -> int | None:
        """The block a [CLS]-row or received-attention signal reads (`method` resolves its aliases); None: not such
        a signal, or a block past the feature layer (vLLM builds the tower up to it)."""
        for kind in ("cls_attention", RECEIVED):
            block = named_block(signal, kind, method, self.name, self.num_layers, self.feature_layer)
            if block is not None:
                return block if block <= self.feature_layer else None
        return None

    def attention_layer(self, signal: str) -> int:
        if signal in ("cls_attention", "keys"):
            return self.feature_layer
        return int(signal.removeprefix("cls_attention@")) % self.num_layers

    def valid(self, method, pixel_values: torch.Tensor) -> torch.Tensor | None:
        """[C, N] valid tokens of crops [C, 3, H, W] for methods that skip the pad-to-square border, else None."""
        if getattr(method, "excludes_pad_border", False):
            return outside_pad_border(pixel_values, self.patch)
        return None

    def tower_shape(self) -> TowerShape:
        """The CLIP tower as a tower method (ToMe) reads it."""
        return llava_shape(self.hf_config, self.name, self.feature_layer)

    def count(self, method, pixel_values: torch.Tensor) -> int:
        """Placeholders of one image [3, H, W] (known before the encoder; ToMe: N - sum r'_l, host integers)."""
        if isinstance(method, TowerMethod):
            return TowerStage(method, self.tower_shape()).counts([self.grid])[0]
        valid = self.valid(method, pixel_values[None])
        n = self.side * self.side if valid is None else int(valid.sum())
        grid = (1, n) if EncoderStage(method).placed else self.grid  # placed: the image's run as the LLM gets it
        count = method.count_before_encoding(n, grid, 1)
        if count is None:
            raise error(f"{method.name}'s token count on {self.name} depends on the data; {why_counts()}")
        return count

    def check(self, config: ServingConfig) -> None:
        """Refuse at start what this family cannot serve (signals, layout, counts decided by the data)."""
        tower.check(config, self.name)  # ToMe served, PixelPrune refused naming why
        if config.tower is not None:
            if not self.has_cls:
                raise error(
                    f"{config.tower.name} on {self.name} merges after [CLS] and sends the feature layer's tokens "
                    "without it (vision_feature_select_strategy='default', a feature layer inside the tower); this "
                    f"config has {self.hf_config.vision_feature_select_strategy!r} at layer "
                    f"{self.hf_config.vision_feature_layer}"
                )
            if config.layout != "native":
                raise error(f"layout={config.layout!r} is not available for {self.name}; it has: native")
            try:  # its schedule on this tower (an r list longer than the blocks up to the feature layer: refused)
                TowerStage(config.tower, self.tower_shape()).counts([self.grid])
            except Exception as err:  # noqa: BLE001 - the plugin's errors name vtoken
                raise error(str(err)) from None
            return
        method = config.method
        check_modality(method, self.name)  # first: a method for videos only is refused for that, not its signals
        check_signals_served(method, self.signals(method), self.name)
        check_clip(method, self.hf_config)
        if config.layout != "native":
            raise error(f"layout={config.layout!r} is not available for {self.name}; it has: native")
        n = self.side * self.side
        if method.count_before_encoding(n, self.grid, 1) is None:
            raise error(
                f"{method.name} ({method!r}) decides its token count on {self.name} from the data; {why_counts()}"
            )


def why_counts() -> str:
    return (
        "vLLM sizes a prompt's image placeholders before the encoder runs, so only methods whose count is known "
        "then are served (a fraction or count budget with scope='crop'); use vtoken.patch on transformers for this"
    )


def check_clip(method, hf_config: Any) -> None:
    """CDPruner's CLIP checkpoint must read the tower's width (refused at start otherwise, as `vtoken.patch` does)."""
    if "clip_features" in method.requires:
        try:
            method.check_clip_width(hf_config.vision_config.hidden_size)
        except Exception as err:  # noqa: BLE001 - the plugin's errors name vtoken
            raise error(str(err)) from None


def check_modality(method, family: str) -> None:
    """Refuse a method that does not act on images (VidCom2: videos only) on a family served for images."""
    try:
        check_takes(method, {"image"}, f"{family} in vLLM", "use it with vtoken.patch on transformers on a video model")
    except Exception as err:  # noqa: BLE001 - the plugin's errors name vtoken
        raise error(str(err)) from None


def check_signals_served(method, available: set[str], family: str, common=COMMON_SIGNALS) -> None:
    """Refuse a method needing signals `family` cannot provide in vLLM (the encoder stage's check; `common`: the
    common signals this family's vLLM path fills)."""
    try:
        check_signals(method, available, f"{family} in vLLM", common=common)
    except Exception as err:  # noqa: BLE001 - the plugin's errors name vtoken
        raise error(str(err)) from None


def check_counts(method, produced: list[int], planned: list[int], where: str) -> None:
    """The encoder must fill exactly the placeholders the front end planned (a mismatch would shift the prompt)."""
    if produced != planned:
        raise RuntimeError(
            f"vtoken: {method.name} kept {produced} tokens per {where} but the prompt holds {planned} placeholders "
            "(sized before the encoder ran); please report this"
        )


def checked_config(hf_config: Any, family_cls=LlavaFamily) -> ServingConfig | None:
    config = serving_config(hf_config)
    if config is not None:
        family_cls(hf_config).check(config)
    return config


class PrunedImagePlaceholders(questions.QuestionProcessorMixin):
    """A LLaVA-style vLLM processor whose image placeholder runs hold the kept count (`kept_count`); without a
    `vtoken` entry, or for images given as embeddings (no encoder runs), the stock runs."""

    def serving_entry(self, hf_config: Any) -> ServingConfig | None:
        return checked_config(hf_config)

    def kept_count(self, hf_config: Any, method: Any, images: Any, item: int, out_mm_kwargs: Any) -> int:
        raise NotImplementedError

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        updates = super()._get_prompt_updates(
            mm_items, questions.without_question(hf_processor_mm_kwargs), out_mm_kwargs
        )
        hf_config = self.info.get_hf_config()
        config = self.serving_entry(hf_config)
        if config is None:
            return updates
        from vllm.multimodal.parse import ImageProcessorItems
        from vllm.multimodal.processing import PromptReplacement

        images = mm_items.get_items("image", ImageProcessorItems) if "image" in mm_items else None
        stock = updates[0]

        def replacement(item: int):
            if images is None or not isinstance(images, ImageProcessorItems):
                return stock.replacement(item)  # image embeddings given: no encoder runs, nothing to prune
            return [hf_config.image_token_index] * self.kept_count(
                hf_config, config.tower or config.method, images, item, out_mm_kwargs
            )

        return [PromptReplacement(modality="image", target=stock.target, replacement=replacement)]


class LlavaProcessor(PrunedImagePlaceholders, LlavaMultiModalProcessor):
    """LLaVA-1.5's processor with placeholder runs of the kept count."""

    def kept_count(self, hf_config, method, images, item, out_mm_kwargs) -> int:
        return LlavaFamily(hf_config).count(method, out_mm_kwargs["image"][item]["pixel_values"].data)


def build_processor(info, dummy_inputs):
    if isinstance(info, LlavaProcessingInfo):
        return LlavaProcessor(info, dummy_inputs)
    return _build_llava_or_pixtral_hf_processor(info, dummy_inputs)


class PruningModel:
    """What the LLaVA-style vLLM models share: the parsed `vtoken` entry (`serving_entry`; None: the stock model),
    the question's embedding (MMTok), and an `embed_multimodal` that hands pixel inputs to `pruned`."""

    serving_entry = staticmethod(checked_config)

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vtoken = self.serving_entry(self.config)
        self.vtoken_model_config = vllm_config.model_config
        self._vtoken_tokenizer = None

    def pruned(self, image_input: dict[str, Any], asked: Any) -> tuple[torch.Tensor, ...]:
        """[k_i, D] embeddings of the kept tokens of every image of vLLM's parsed pixel input."""
        raise NotImplementedError

    def embed_multimodal(self, **kwargs: object):
        asked = kwargs.pop(questions.FIELD, None)
        if self.vtoken is None:
            return super().embed_multimodal(**kwargs)
        image_input = self._parse_and_validate_image_input(**kwargs)
        if image_input is None:
            return []
        if image_input["type"] != "pixel_values":
            return self._process_image_input(image_input)
        return self.pruned(image_input, asked)

    def text_query(self, asked: Any, family: str) -> TextQuery | None:
        """The questions of a batch of images (MMTok), embedded by the LLM's own input embeddings."""
        if asked is None:
            return None
        if self._vtoken_tokenizer is None:
            from vllm.tokenizers import cached_tokenizer_from_config

            self._vtoken_tokenizer = cached_tokenizer_from_config(self.vtoken_model_config)
        tokenizer, embed_ids = self._vtoken_tokenizer, self.get_language_model().embed_input_ids
        device = next(self.parameters()).device

        def embed(text: str) -> torch.Tensor:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            return embed_ids(torch.tensor(ids, dtype=torch.long, device=device))

        return TextQuery(questions.decode(asked), family, embed)


class Llava(PruningModel, LlavaForConditionalGeneration):
    """`LlavaForConditionalGeneration` that prunes visual tokens when the config carries a `vtoken` entry (and
    is the stock model otherwise)."""

    def pruned(self, image_input: dict[str, Any], asked: Any) -> tuple[torch.Tensor, ...]:
        pixel_values = image_input["pixel_values"]
        if isinstance(pixel_values, list):
            pixel_values = torch.stack(pixel_values)
        if self.vtoken.tower is not None:
            return self.merged(pixel_values)
        method, family = self.vtoken.method, LlavaFamily(self.config)
        features, signals = encode_crops(self, family, method, pixel_values)  # [B, N, Dv], before the projector
        stage = EncoderStage(method)
        if stage.placed:  # DivPrune: among the projected tokens as placed (all N of each image)
            embeds = placed_rows(stage, list(self.multi_modal_projector(features)))
        else:
            valid = family.valid(method, pixel_values)
            tokens = VisualTokens(features, family.grid, signals, torch.arange(len(features)),
                                  None if valid is None else valid.to(features.device))  # fmt: skip
            sources = SignalSources(self.multi_modal_projector, self.text_query(asked, family.name))
            selection, _ = stage.select(tokens, sources)
            embeds = kept_embeddings(tokens, selection, self.multi_modal_projector)
        check_counts(method, [len(e) for e in embeds], [family.count(method, p) for p in pixel_values], "image")
        return tuple(embeds)

    def merged(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """ToMe: vLLM's CLIP tower on images [B, 3, H, W], merging in its blocks -> per image [N', D] projected
        tokens (every token leaving the tower reaches the LLM, in the method's order)."""
        method, family = self.vtoken.tower, LlavaFamily(self.config)
        layers = self.vision_tower.vision_model.encoder.layers
        with MergingBlocks(method, layers, family.tower_shape()):
            hidden = self.vision_tower(pixel_values, feature_select_strategy="default")  # [B, N', Dv], no [CLS]
        embeds = list(self.multi_modal_projector(hidden))
        check_counts(method, [len(e) for e in embeds], [family.count(method, p) for p in pixel_values], "image")
        return tuple(embeds)


def encode_crops(model, family: LlavaFamily, method, crops: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """vLLM's CLIP tower (built up to the feature layer) on crops [C, 3, H, W], once, with [CLS]-row probes on the
    layers the method reads: patch features [C, N, Dv] before the projector, and the signals as callables
    (resolved by the encoder stage), "cls_token" ([C, Dv], the [CLS] feature) for methods that send it (VisionZip)."""
    layers = model.vision_tower.vision_model.encoder.layers
    probes: dict[int, QKVClsProbe] = {}
    wanted = {}  # signal -> (probe, what it reads)
    for name in method.requires:
        if name == "keys" or name.startswith("cls_attention") or name.startswith(RECEIVED):
            layer = family.feature_layer if name == "keys" else family.tower_block(method, name)
            probe = probes.setdefault(layer, QKVClsProbe(layers[layer].self_attn))
            read = "patch_keys" if name == "keys" else "received" if name.startswith(RECEIVED) else "scores"
            wanted[name] = (probe, read)
    with_cls = "cls_token" in method.uses and family.has_cls
    strategy = "full" if with_cls else model.config.vision_feature_select_strategy
    with ExitStack() as stack:
        for probe in probes.values():
            stack.enter_context(probe)
        hidden = model.vision_tower(crops, feature_select_strategy=strategy)
    signals: dict[str, Any] = {name: (lambda probe=probe, read=read: getattr(probe, read))
                               for name, (probe, read) in wanted.items()}  # fmt: skip
    if with_cls:
        signals["cls_token"] = hidden[:, 0]
        hidden = hidden[:, 1:]
    if "clip_features" in method.requires:
        signals["clip_features"] = lambda features=hidden: method.clip_features(features)
    return hidden, signals


def placed_rows(stage: EncoderStage, placed: list[torch.Tensor]) -> list[torch.Tensor]:
    """A placed selection (DivPrune) on every image's run [L_i, D] as the LLM receives it: the kept rows
    [k_i, D] of every run (`EncoderStage.select_placed`, as vtoken's transformers adapters)."""
    picks = stage.select_placed(placed)
    return placed if picks is None else picks.take(picks.padded)


def kept_embeddings(tokens: VisualTokens, selection: Selection, project) -> list[torch.Tensor]:
    """Per crop, [k_c, D] projected kept tokens (`vtoken.geometry.kept.kept_rows`, as vtoken's LLaVA adapter)."""
    return list(kept_rows(selection, tokens.features, tokens.signals, project).split(selection.counts_per_crop()))


PROCESSOR = dict(processor=build_processor, info=_build_llava_or_pixtral_hf_info)
