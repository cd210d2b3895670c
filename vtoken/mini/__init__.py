"""vtoken-mini: a small trained LLaVA-1.5-architecture model and the procedural visual-QA task it was trained on.

`vqa` generates the task (images, questions, one-word answers) from seeds; `model` builds and loads the shipped
checkpoint (`weights/`); `train` reproduces it; `evaluate` scores a (patched) model on it.
"""

from __future__ import annotations

from PIL import Image

from . import vqa

# the CLI's and demo's default example: a test scene whose question is about one small shape (17 px, a few
# patches), chosen among those the shipped model answers right unpatched and with FasterVLM at 25 %
EXAMPLE = ("test", 3, "shape")


def example() -> tuple[Image.Image, str, str]:
    """(image, question, answer) of the default example: a generated scene, no files needed."""
    split, index, kind = EXAMPLE
    image, questions = vqa.sample(split, index)
    question = questions[vqa.QUESTION_TYPES.index(kind)]
    return image, question.text, question.answer
