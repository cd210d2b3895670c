"""The demo as a user meets it: served on a free localhost port, driven by headless Chromium (Playwright).

Runs the default, every offered method, an empty question (a readable error, old outputs cleared) and a video;
checks there is no error badge and that the overlays are drawn, and that the page shows everything it holds at the
default window size (1280 x 800) and on a phone-width window (390 x 844): every gallery picture inside the gallery
(no fixed height cutting a row), every table cell's text inside its cell and every table inside its box, video
frames drawn large enough to read, and a sweep that offers only methods it can sweep. Screenshots of each state
are saved as test artefacts in pytest's tmp_path (and copied to $VTOKEN_DEMO_SCREENSHOTS, a directory, if set).
Needs Chromium and Playwright: on Debian/Ubuntu `apt-get install -y chromium` and `pip install playwright` (no
browser download; Debian's binary is used). Under `CI=true` a missing browser fails the test instead of skipping.
"""

import math
import os
import re
import shutil
import socket

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
TIMEOUT = 60_000  # ms, per step
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
MIN_FRAME_PX = 80  # a video frame's drawn height, at least

# Problems in what an element shows, as JS: [] when everything it holds is visible (checked by sizes: a picture
# outside its gallery, a box that scrolls or clips its content, a cell whose text overflows it)
LAYOUT_JS = """
([gallerySel, tableSels]) => {
  const out = [];
  const g = gallerySel && document.querySelector(gallerySel);
  if (g) {
    const box = g.getBoundingClientRect();
    for (const img of g.querySelectorAll('img')) {
      const r = img.getBoundingClientRect();
      if (r.height < 2 || r.bottom > box.bottom + 1 || r.top < box.top - 1 || r.right > box.right + 1)
        out.push(`gallery picture ${img.alt} at ${Math.round(r.top)}-${Math.round(r.bottom)} outside the gallery `
                 + `${Math.round(box.top)}-${Math.round(box.bottom)}`);
    }
    for (const wrap of g.querySelectorAll('.grid-wrap'))
      if (wrap.scrollHeight > wrap.clientHeight + 2)
        out.push(`gallery scrolls: ${wrap.scrollHeight} > ${wrap.clientHeight}`);
  }
  for (const sel of tableSels) {
    const root = document.querySelector(sel);
    const table = root && root.querySelector('table');
    if (!table) continue;
    const box = root.getBoundingClientRect();
    const t = table.getBoundingClientRect();
    if (t.right > box.right + 1 || t.left < box.left - 1)
      out.push(`${sel}: table ${Math.round(t.width)} px wide in a ${Math.round(box.width)} px box`);
    for (const el of [root, ...root.querySelectorAll('*')]) {
      if (el.scrollWidth > el.clientWidth + 2 && el.clientWidth > 0)
        out.push(`${sel}: ${el.tagName} clips ${el.scrollWidth} > ${el.clientWidth} px wide`);
      const cs = getComputedStyle(el);
      if (['hidden', 'auto', 'scroll', 'clip'].includes(cs.overflowY) && el.scrollHeight > el.clientHeight + 2)
        out.push(`${sel}: ${el.tagName} clips ${el.scrollHeight} > ${el.clientHeight} px tall`);
    }
  }
  return out;
}
"""


def chromium_path() -> str | None:
    for candidate in ("/usr/lib/chromium/chromium", "chromium", "chromium-browser", "google-chrome"):
        found = candidate if os.path.exists(candidate) else shutil.which(candidate)
        if found:
            return found
    return None


def missing(why: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; CI must provide it (apt-get install -y chromium; pip install playwright)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright is not installed")
    path = chromium_path()
    if path is None:
        missing("no Chromium found")
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        except Exception as err:  # noqa: BLE001 (any launch failure means no usable browser)
            missing(f"Chromium at {path} does not start: {err}")
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def url():
    from vtoken.demo.app import CSS, build_demo

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo = build_demo("vtoken-mini")
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, css=CSS)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


def run_and_wait(page, configurations: int) -> None:
    """Click Run and wait until the gallery shows the unpatched model and every configuration."""
    page.get_by_role("button", name="Run", exact=True).click()
    gallery = page.locator("#vtoken-kept img")
    page.wait_for_function(
        "n => document.querySelectorAll('#vtoken-kept img').length >= n "
        "|| getComputedStyle(document.querySelector('#vtoken-error') || document.body).display !== 'none' "
        "&& !!document.querySelector('#vtoken-error')?.innerText",
        arg=configurations + 1,
        timeout=TIMEOUT,
    )
    assert_no_error(page)
    assert gallery.count() >= configurations + 1
    gallery.evaluate_all("imgs => imgs.forEach(i => { i.loading = 'eager'; })")  # off-screen ones too
    page.wait_for_function(  # every overlay drawn and loaded
        "() => [...document.querySelectorAll('#vtoken-kept img')].every(i => i.complete && i.naturalWidth > 0)",
        timeout=TIMEOUT,
    )


def assert_no_error(page) -> None:
    error = page.locator("#vtoken-error")
    assert not (error.count() and error.is_visible() and error.inner_text().strip()), error.inner_text()
    assert page.get_by_text("Error", exact=True).count() == 0  # Gradio's error badge


def check_layout(page, shots, name: str, tables=("#vtoken-results",), gallery: str | None = "#vtoken-kept") -> None:
    """Save a full-page screenshot `name` and assert everything `gallery` and `tables` hold is visible."""
    page.wait_for_timeout(300)  # layout settles after Gradio's updates
    path = shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    problems = page.evaluate(LAYOUT_JS, [gallery, list(tables)])
    assert problems == [], f"{name} ({path}): {problems}"


def frame_heights(page) -> list[float]:
    """The drawn height of one video frame in each gallery picture whose caption names frames."""
    heights = []
    for info in page.locator("#vtoken-kept img").evaluate_all(
        "imgs => imgs.map(i => [i.alt, i.clientWidth, i.clientHeight, i.naturalWidth, i.naturalHeight])"
    ):
        alt, width, height, natural_w, natural_h = info
        found = re.search(r"(\d+) frames", alt or "")
        if not found or not natural_w:
            continue
        n = int(found[1])
        rows = math.ceil(n / math.ceil(math.sqrt(n)))  # the picture's grid of frames (views.picture)
        drawn = min(height, width * natural_h / natural_w)  # object-fit: contain
        heights.append(drawn / rows)
    return heights


@pytest.fixture
def shots(tmp_path):
    yield tmp_path
    target = os.environ.get("VTOKEN_DEMO_SCREENSHOTS")
    if target:
        os.makedirs(target, exist_ok=True)
        for png in tmp_path.glob("*.png"):
            shutil.copy(png, target)


def test_the_page_in_a_browser(browser, url, shots):
    page = browser.new_page(viewport=DESKTOP)
    page.set_default_timeout(TIMEOUT)
    page.goto(url)
    run = page.get_by_role("button", name="Run", exact=True)
    run.wait_for()
    methods = page.locator("#vtoken-methods")
    methods.get_by_text("methods", exact=True).wait_for()  # the selector's visible name

    run_and_wait(page, 1)  # the default: vtoken-mini, its generated scene and FasterVLM
    assert "diamond" in page.locator("#vtoken-results").inner_text()  # the scene's expected answer, unpatched

    offered = methods.locator("input[type=checkbox]")
    names = offered.evaluate_all("boxes => boxes.map(b => b.name)")
    assert {"fastervlm", "fastv", "mustdrop", "hired", "mmtok", "pool", "random", "fourier"} <= set(names)
    for i in range(offered.count()):
        if not offered.nth(i).is_checked():
            offered.nth(i).check()
    page.get_by_label("timed runs per setting (interleaved, after a warm-up)").last.fill("1")
    page.get_by_label("max new tokens").last.fill("2")
    run_and_wait(page, len(names))  # every offered method, each with its own defaults
    table = page.locator("#vtoken-results").inner_text()
    for name in names:
        assert name + "(" in table or name in table
    assert page.locator("#vtoken-kept img").count() > 3  # more than one gallery row: none of them cut
    check_layout(page, shots, "1-every-method-1280x800")
    page.set_viewport_size(PHONE)
    check_layout(page, shots, "2-every-method-phone")
    page.set_viewport_size(DESKTOP)

    page.get_by_label("question").fill("")  # empty input: refused with a message, old outputs cleared
    run.click()
    page.locator("#vtoken-error").get_by_text("question is empty").wait_for()
    assert page.locator("#vtoken-kept img").count() == 0

    page.get_by_label("model").click()  # a video model and the generated clip
    page.get_by_role("option", name="tiny-qwen2-vl", exact=True).click()
    page.get_by_text("Qwen2VLForConditionalGeneration", exact=True).wait_for()
    page.get_by_label("example").click()
    page.get_by_role("option", name="generated clip (8 frames panning over the scene)").click()
    page.get_by_text("vtoken_example_clip").wait_for()  # the clip is in the video box
    run_and_wait(page, 1)
    heights = frame_heights(page)
    assert heights and min(heights) >= MIN_FRAME_PX, heights  # frames drawn large enough to read
    check_layout(page, shots, "3-video-1280x800")
    page.set_viewport_size(PHONE)
    assert min(frame_heights(page)) >= MIN_FRAME_PX
    check_layout(page, shots, "4-video-phone")
    page.set_viewport_size(DESKTOP)

    page.get_by_role("tab", name="Budget sweep (vtoken-mini)").click()  # the sweep, small: 10 questions, 1 point
    sweepable = page.locator("#vtoken-sweep-methods input[type=checkbox]").evaluate_all("b => b.map(x => x.name)")
    assert "sparse_prefill" not in sweepable and "mustdrop" not in sweepable and "fastervlm" in sweepable
    for box, keep in (("#vtoken-sweep-methods", "random"), ("#vtoken-budgets", "10%")):
        boxes = page.locator(f"{box} input[type=checkbox]")
        for i in range(boxes.count()):
            boxes.nth(i).set_checked(boxes.nth(i).get_attribute("name") == keep)
    page.get_by_label("questions").last.fill("10")
    page.get_by_role("button", name="Run sweep").click()
    page.locator("#vtoken-sweep").get_by_text("10%", exact=True).wait_for()  # the point: random at 10 %
    sweep = page.locator("#vtoken-sweep").inner_text()
    assert "random" in sweep and "n=10" in sweep and "±" in sweep  # the accuracy with its uncertainty
    assert_no_error(page)
    check_layout(page, shots, "5-sweep-1280x800", tables=("#vtoken-sweep",), gallery=None)
    page.set_viewport_size(PHONE)
    check_layout(page, shots, "6-sweep-phone", tables=("#vtoken-sweep",), gallery=None)
    page.close()
