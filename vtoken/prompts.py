"""Prompts in the model's own chat format (what users pass to the processor beside the images)."""

from __future__ import annotations


def build_prompt(processor, question: str, num_images: int = 1, num_videos: int = 0) -> str:
    """The model's own chat-formatted prompt for one user turn with images, videos and `question`."""
    content = [{"type": "image"}] * num_images + [{"type": "video"}] * num_videos + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True)
