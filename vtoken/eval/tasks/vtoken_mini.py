"""lmms-eval glue of the vtoken-mini VQA tasks (loaded by lmms-eval from the YAML files beside it).

The data comes from `vtoken.eval.data` (generated into a cache on first use, no dataset hub). A question is right
when the first word of the answer is the one-word target, as `vtoken.mini.evaluate` scores it.
"""

from __future__ import annotations

from datasets import Dataset, DatasetDict
from lmms_eval.api.task import ConfigurableMessagesTask
from PIL import Image

from vtoken.eval import data


class VQATask(ConfigurableMessagesTask):
    """A chat task whose rows come from `vtoken.eval.data` instead of a hub dataset.

    metadata.modality: "image" or "video"; metadata.kind: keep only questions of this type (default: all).
    """

    def __init__(self, *args, config: dict | None = None, **kwargs) -> None:
        config = dict(config or {})
        config.pop("class", None)
        super().__init__(*args, config=config, **kwargs)

    def download(self, dataset_kwargs=None) -> None:
        metadata = self.config.metadata or {}
        rows = data.questions(metadata.get("modality", "image"))
        if metadata.get("kind"):
            rows = [row for row in rows if row["kind"] == metadata["kind"]]
        self.dataset = DatasetDict({self.config.test_split: Dataset.from_list(rows)})
        self.dataset_no_image = self.dataset


def doc_to_messages(doc: dict) -> list[dict]:
    """One user turn: the scene's image (PIL) or clip (MP4 path), then the question."""
    if doc["file"].endswith(".mp4"):
        visual = {"type": "video", "url": str(data.video_path(doc))}
    else:
        with Image.open(data.image_path(doc)) as image:
            visual = {"type": "image", "url": image.convert("RGB")}
    return [{"role": "user", "content": [visual, {"type": "text", "text": doc["question"]}]}]


def doc_to_visual(doc: dict) -> list:
    content = doc_to_messages(doc)[0]["content"][0]
    return [content["url"]]


def doc_to_text(doc: dict) -> str:
    return doc["question"]


def doc_to_target(doc: dict) -> str:
    return doc["answer"]


def process_results(doc: dict, results: list[str]) -> dict:
    """accuracy: 1 when the answer's first word is the target word."""
    words = results[0].split()
    return {"accuracy": float(bool(words) and words[0] == doc["answer"])}
