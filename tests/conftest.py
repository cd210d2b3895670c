import numpy as np
import pytest
import torch
from PIL import Image

import vtoken
from vtoken.zoo import build_prompt, tiny_llava

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llava():
    """(model, processor): the built-in tiny LLaVA-1.5, fp32, SDPA everywhere."""
    return tiny_llava()


@pytest.fixture(autouse=True)
def _always_unpatch(request):
    """Never let a failing test leave the shared model patched."""
    yield
    if "llava" in request.fixturenames:
        model = request.getfixturevalue("llava")[0]
        if vtoken.handle_of(model) is not None:
            vtoken.unpatch(model)


@pytest.fixture(scope="session")
def photos():
    """Real photos shipped with scikit-image, as PIL images of different sizes and aspect ratios."""
    from skimage import data

    return {
        "astronaut": Image.fromarray(data.astronaut()),  # 512x512
        "chelsea": Image.fromarray(data.chelsea()),  # 451x300
        "coffee": Image.fromarray(data.coffee()),  # 600x400
        "rocket": Image.fromarray(data.rocket()),  # 427x640
    }


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def inputs_for(processor, images, questions):
    """Processor inputs for one image per prompt, left-padded."""
    prompts = [build_prompt(processor, q) for q in questions]
    return processor(images=images, text=prompts, return_tensors="pt", padding=True)
