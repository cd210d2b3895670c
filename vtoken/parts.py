"""Parts vtoken's built-in models are assembled from, shared by the tiny zoo (`vtoken.zoo`) and vtoken-mini
(`vtoken.mini`): a byte-level BPE tokenizer trained in-process, LLaVA's chat template, processor and config."""

from __future__ import annotations

_CORPUS = (
    "USER: ASSISTANT: what is in the image? describe the image in detail. what colour is the object? "
    "how many shapes are there? is there a red circle at the top left? answer the question using a single word "
    "or phrase. the image shows a cat sitting on a mat next to a cup of coffee. an astronaut in a white suit "
    "stands in front of a flag. a rocket on a launch pad. red green blue yellow circle square triangle star one "
    "two three four five yes no left right top bottom centre small large"
)


LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: "
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>\n"
    "{% elif item['type'] == 'video' %}<video>\n{% endif %}{% endfor %}"
    "{% for item in message['content'] %}{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %} "
    "{% else %}ASSISTANT: {% for item in message['content'] %}{{ item['text'] }}{% endfor %}</s>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def tiny_tokenizer(
    special_tokens: tuple[str, ...] = ("<image>",), vocab_size: int = 384, named: dict[str, str] | None = None
):
    """A byte-level BPE tokenizer trained in-process on a fixed corpus (deterministic, ~ms).

    named: the processor-facing names of special tokens (default {"image_token": "<image>"}).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = ("<pad>", "<s>", "</s>")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*base, *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="left",
        extra_special_tokens=named or {"image_token": "<image>"},
    )


def llava_processor(tokenizer=None, image_size: int = 336, patch_size: int = 14):
    """A real `LlavaProcessor` (CLIP image processor + chat template) around `tokenizer` (default: the tiny BPE)."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer or tiny_tokenizer(),
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )


def llava_config(tokenizer, vision: dict, text: dict, image_size: int = 336, patch_size: int = 14):
    """A `LlavaConfig` (CLIP tower with [CLS] + Llama) whose special ids come from `tokenizer`."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    return LlavaConfig(
        vision_config=CLIPVisionConfig(image_size=image_size, patch_size=patch_size, **vision),
        text_config=LlamaConfig(
            vocab_size=text.pop("vocab_size", len(tokenizer)),
            max_position_embeddings=4096,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **text,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        pad_token_id=tokenizer.pad_token_id,
    )
