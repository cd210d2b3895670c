"""The demo as a user meets it: served on a free localhost port, driven by headless Chromium (Playwright).

Runs the default, every offered method, an empty question (a readable error, old outputs cleared) and a video;
checks there is no error badge and that the overlays are drawn. Needs Chromium and Playwright: on Debian/Ubuntu
`apt-get install -y chromium` and `pip install playwright` (no browser download; Debian's binary is used). Under
`CI=true` a missing browser fails the test instead of skipping it.
"""

import os
import shutil
import socket

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
TIMEOUT = 60_000  # ms, per step


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


def test_the_page_in_a_browser(browser, url):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
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
        assert name + "(" in table

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
    assert "frames" in page.locator("#vtoken-kept").inner_text() or page.locator("#vtoken-kept img").count() >= 2

    page.get_by_role("tab", name="Budget sweep (vtoken-mini)").click()  # the sweep, small: 10 questions, 1 point
    for box, keep in (("#vtoken-sweep-methods", "random"), ("#vtoken-budgets", "10%")):
        boxes = page.locator(f"{box} input[type=checkbox]")
        for i in range(boxes.count()):
            boxes.nth(i).set_checked(boxes.nth(i).get_attribute("name") == keep)
    page.get_by_label("questions").last.fill("10")
    page.get_by_role("button", name="Run sweep").click()
    page.locator("#vtoken-sweep").get_by_text("10%", exact=True).wait_for()  # the point: random at 10 %
    assert "random" in page.locator("#vtoken-sweep").inner_text()
    assert_no_error(page)
    if os.environ.get("VTOKEN_DEMO_SCREENSHOT"):  # a PNG path: to look at the page after the test
        page.screenshot(path=os.environ["VTOKEN_DEMO_SCREENSHOT"], full_page=True)
    page.close()
