"""The browser playground (services/http/playground) in Debian's Chromium, driven by Playwright, against the e2e
stack: controls found by role and accessible name, every figure read from the server. The stack serves the demo text
model; the default model's "Paris" is asked in tests/e2e/test_e2e_chat_smollm2.py, the API key in test_e2e_auth.py.
With GENSERVE_SCREENSHOTS=1 (`make screenshots`) the tests also write docs/img/playground-*.png.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from PIL import Image
from playwright.sync_api import expect

from genserve.services.client import Client
from tests.e2e.playground import (
    ask,
    assert_fits_a_phone,
    chromium,
    page_at,
    partial_renders,
    screenshot,
    screenshots_wanted,
    wait_ready,
    watch_answer,
)

pytestmark = pytest.mark.e2e

# Records, in order, every preview frame shown and the final images' arrival.
WATCH_IMAGES = """() => {
  window.seen = [];
  const preview = document.getElementById('preview');
  new MutationObserver(() => window.seen.push('preview:' + preview.src.length + ':' + preview.alt))
    .observe(preview, {attributes: true, attributeFilter: ['src']});
  new MutationObserver(() => window.seen.push('final'))
    .observe(document.getElementById('diffusion-results'), {childList: true});
}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as running:
        yield running


@pytest.fixture
def page(browser, stack) -> Iterator[Any]:
    with page_at(browser, f"http://127.0.0.1:{stack.http_port}/") as opened:
        wait_ready(opened)
        yield opened


def _images_tab(page, form: str) -> Any:
    page.get_by_role("tab", name="Images").click()
    return page.get_by_role("form", name=form)


def test_a_chat_answer_streams_in_with_its_timings_and_stays_after_a_reload(page, stack) -> None:
    watch_answer(page)
    page.get_by_role("spinbutton", name="Max tokens").fill("48")
    page.get_by_role("spinbutton", name="Seed").fill("1")
    ask(page, "Tell me about the sea")
    answer = page.locator(".message.assistant").last
    text = answer.locator(".content").text_content()
    partial = partial_renders(page, text)
    assert text and len(partial) >= 3, f"{len(partial)} updates before the end: {partial}"
    note = answer.locator(".stats").text_content()
    assert "TTFT" in note and "tok/s" in note, note
    # The server's own answer for the same body, greedy over the same seed: the page showed exactly that text.
    body = {"model": "text", "messages": [{"role": "user", "content": "Tell me about the sea"}], "max_tokens": 48,
            "seed": 1, "temperature": 1.0, "top_p": 1.0}
    reply = httpx.post(f"{stack.http_url}/chat/completions", json=body, timeout=60).json()
    kept = page.evaluate("JSON.parse(localStorage.getItem('genserve.chat')).messages")
    assert kept[-1] == {"role": "assistant", "content": reply["choices"][0]["message"]["content"], "note": note}
    page.reload()
    wait_ready(page)
    assert page.locator(".message.assistant .content").last.text_content() == text  # kept in localStorage
    assert page.locator(".message.user").last.text_content().startswith("You")
    page.get_by_role("button", name="Python").click()
    snippet = page.get_by_label("Chat request as code").text_content()
    compile(snippet, "snippet.py", "exec")  # the openai SDK call is valid Python
    assert "client.chat.completions.create(" in snippet and '"max_tokens"' not in snippet
    page.get_by_role("button", name="curl").click()
    assert page.get_by_label("Chat request as code").text_content().startswith(
        f"curl http://127.0.0.1:{stack.http_port}/v1/chat/completions")
    assert_fits_a_phone(page)


# How long the models panel may take to show a change: its 2 s refresh after Ray's metrics export (1 s in e2e).
LIVE_MS = 15_000
# An answer that cannot end before its max tokens, whatever the model: a JSON string longer than they can hold.
LONG_ANSWER = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}}, "required": ["story"]}


def test_stop_in_mid_answer_frees_the_kv_blocks_on_the_server(page, client: Client) -> None:
    info = client.model_info()
    page.get_by_role("spinbutton", name="Max tokens").fill(str(min(1024, info.max_context - 64)))
    page.get_by_role("checkbox", name="JSON-schema mode").check()
    page.get_by_role("textbox", name="JSON schema").fill(json.dumps(LONG_ANSWER))
    page.get_by_role("textbox", name="Message").fill("Tell a long story")
    page.get_by_role("button", name="Send").click()
    page.wait_for_selector(".message.assistant:last-child .content:not(:empty)")  # the answer has begun
    assert client.model_info().kv_blocks_free < info.kv_blocks_total  # the answer holds blocks
    page.get_by_role("button", name="Stop").click()
    stopped = time.monotonic()
    page.wait_for_selector(".message.assistant:last-child[data-state=stopped]")
    while client.model_info().kv_blocks_free != info.kv_blocks_total and time.monotonic() - stopped < 2.0:
        time.sleep(0.05)
    assert client.model_info().kv_blocks_free == info.kv_blocks_total, "the stopped request still holds KV blocks"
    assert page.get_by_role("button", name="Send").is_enabled()
    assert page.locator(".message.assistant:last-child .stats").text_content().startswith("stopped")


def test_json_schema_mode_answers_in_the_schema_and_regenerate_replaces_the_answer(page) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    page.get_by_role("checkbox", name="JSON-schema mode").check()
    page.get_by_role("textbox", name="JSON schema").fill(json.dumps(schema))
    page.get_by_role("spinbutton", name="Max tokens").fill("150")
    ask(page, "Is the sea blue?")
    answers = []
    for _ in range(2):
        kept = page.evaluate("JSON.parse(localStorage.getItem('genserve.chat')).messages")
        assert [m["role"] for m in kept] == ["user", "assistant"]
        assert kept[-1]["note"].endswith("stop"), kept[-1]
        answers.append(json.loads(kept[-1]["content"]))
        assert set(answers[-1]) == {"answer"} and answers[-1]["answer"] in ("yes", "no")
        if len(answers) == 1:
            page.get_by_role("button", name="Regenerate").click()
            page.wait_for_selector(".message.assistant:last-child:not([data-state=streaming])")
    assert page.locator(".message.assistant").count() == 1


def test_html_in_a_message_or_an_answer_stays_text(page) -> None:
    hostile = '<b>bold</b><script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
    page.get_by_role("spinbutton", name="Max tokens").fill("4")
    page.get_by_role("textbox", name="Message").fill(hostile)
    page.get_by_role("textbox", name="Message").press("Enter")  # Enter sends (Shift+Enter would break the line)
    page.wait_for_selector(".message.assistant:last-child:not([data-state=streaming])")
    user = page.locator(".message.user .content").last
    assert user.text_content() == hostile
    assert page.locator("#conversation script, #conversation img, #conversation b").count() == 0
    assert page.evaluate("window.pwned") is None
    # Model output goes through the markdown renderer: markup in it is shown as characters, markdown still renders.
    answer = "Hi **there** `x<y`\n\n<script>window.pwned = 3</script>\n```html\n<img src=x onerror=alert(1)>\n```"
    rendered = page.evaluate("""async (answer) => {
      const {render} = await import('/playground/markdown.js');
      const box = document.createElement('div');
      render(box, answer);
      document.body.append(box);
      return {html: box.innerHTML, text: box.textContent, strong: box.querySelectorAll('strong').length,
              code: box.querySelectorAll('pre code').length, bad: box.querySelectorAll('script, img').length};
    }""", answer)
    assert rendered["bad"] == 0 and rendered["strong"] == 1 and rendered["code"] == 1
    assert "<script>window.pwned = 3</script>" in rendered["text"] and "&lt;script&gt;" in rendered["html"]
    assert page.evaluate("window.pwned") is None


def test_an_image_shows_preview_frames_before_the_final_png(page) -> None:
    form = _images_tab(page, "Text to image")
    page.evaluate(WATCH_IMAGES)
    form.get_by_role("textbox", name="Prompt", exact=True).fill("a large red circle")
    form.get_by_role("spinbutton", name="Steps").fill("8")
    form.get_by_role("spinbutton", name="Seed").fill("5")
    form.get_by_role("button", name="Generate").click()
    final = page.get_by_role("img", name="Generated image 1 of 1 for “a large red circle” (seed 5)")
    final.wait_for()
    seen = page.evaluate("window.seen")
    frames = seen[: seen.index("final")] if "final" in seen else seen
    assert len({f for f in frames if f.startswith("preview:")}) >= 2, seen
    assert "step 8" in page.get_by_role("img", name="Denoising preview", exact=False).get_attribute("alt")
    size = page.evaluate("(img) => [img.naturalWidth, img.naturalHeight]", final.element_handle())
    assert size == [32, 32]
    form.get_by_role("button", name="Python").click()
    snippet = form.get_by_label("Image request as code").text_content()
    compile(snippet, "snippet.py", "exec")  # the openai SDK call is valid Python
    assert 'prompt="a large red circle"' in snippet and '"seed": 5' in snippet and '"steps": 8' in snippet


def test_an_invalid_setting_shows_the_servers_message_next_to_it(page, stack) -> None:
    form = _images_tab(page, "Text to image")
    form.get_by_role("spinbutton", name="Steps").fill("0")
    form.get_by_role("button", name="Generate").click()
    error = page.locator("#steps-error")
    error.wait_for()
    served = httpx.post(f"{stack.http_url}/images/generations", json={"prompt": "a large red circle", "steps": 0},
                        timeout=60)
    assert served.status_code == 400
    assert error.text_content() == f"400: {served.json()['error']['message']}"
    assert form.get_by_role("spinbutton", name="Steps").get_attribute("aria-invalid") == "true"
    page.get_by_role("tab", name="Chat").click()
    page.get_by_role("spinbutton", name="Temperature").fill("3")
    page.get_by_role("textbox", name="Message").fill("Hello")
    page.get_by_role("button", name="Send").click()
    chat_error = page.locator("#temperature-error")
    chat_error.wait_for()
    body = {"model": "text", "messages": [{"role": "user", "content": "Hello"}], "temperature": 3}
    served = httpx.post(f"{stack.http_url}/chat/completions", json=body, timeout=60).json()["error"]
    assert served["param"] == "temperature" and chat_error.text_content() == f"400: {served['message']}"
    assert page.locator(".message").count() == 0  # a refused question leaves no empty answer, and goes back
    assert page.get_by_role("textbox", name="Message").input_value() == "Hello"


def test_a_gan_seed_walk_shows_its_frames(page, tmp_path, monkeypatch) -> None:
    form = _images_tab(page, "GAN samples")
    form.get_by_role("spinbutton", name="Walk frames").fill("6")
    form.get_by_role("button", name="Seed walk").click()
    frames = page.get_by_role("img", name="Seed walk from 3 to 9")
    page.get_by_role("img", name="Seed walk from 3 to 9, frame 6 of 6").wait_for()
    assert frames.count() == 6
    sources = {frames.nth(i).get_attribute("src") for i in range(6)}
    assert len(sources) == 6  # six different images along the walk
    form.get_by_role("button", name="Python").click()  # the same request as a script, run here: the same PNGs
    monkeypatch.chdir(tmp_path)
    exec(compile(form.get_by_label("GAN request as code").text_content(), "snippet.py", "exec"), {})
    written = {f"data:image/png;base64,{base64.b64encode((tmp_path / f'image-{i}.png').read_bytes()).decode()}"
               for i in range(6)}
    assert written == sources


def test_a_vae_upload_shows_the_image_and_its_reconstruction(page, tmp_path) -> None:
    form = _images_tab(page, "VAE round trip")
    square = Image.new("RGB", (64, 48), (250, 250, 250))
    square.paste((200, 30, 30), (16, 8, 48, 40))
    square.save(tmp_path / "square.png")
    form.get_by_label("Image to reconstruct").set_input_files(str(tmp_path / "square.png"))
    reconstruction = page.get_by_role("img", name="VAE reconstruction of square.png")
    reconstruction.wait_for()
    original = page.get_by_role("img", name="Original: square.png, resized to 32×32")
    assert page.locator("#vae-results img").count() == 2
    pixels = []
    for img in (original, reconstruction):
        png = base64.b64decode(img.get_attribute("src").split(",", 1)[1])
        pixels.append(Image.open(io.BytesIO(png)).convert("RGB"))
    assert pixels[0].size == pixels[1].size == (32, 32)
    centre = pixels[1].getpixel((16, 16))
    assert centre[0] > 120 and centre[1] < 110, f"the reconstruction lost the red square: {centre}"
    assert_fits_a_phone(page)
    if screenshots_wanted():  # the whole tab for docs/img, every card filled
        page.get_by_role("form", name="GAN samples").get_by_role("button", name="Seed walk").click()
        page.get_by_role("img", name="Seed walk from 3 to 9, frame 8 of 8").wait_for()
        text_to_image = page.get_by_role("form", name="Text to image")
        text_to_image.get_by_role("spinbutton", name="Seed").fill("5")
        text_to_image.get_by_role("button", name="Generate").click()
        page.get_by_role("img", name="Generated image 1 of 1").wait_for()
        screenshot(page, "images")


def test_the_models_panel_shows_each_service_and_live_kv_blocks(page, stack, client: Client) -> None:
    page.get_by_role("tab", name="Chat").focus()
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")  # the tabs follow the arrow keys
    assert page.get_by_role("tab", name="Models").get_attribute("aria-selected") == "true"
    assert page.evaluate("document.activeElement.id") == "tab-models"
    text = page.get_by_role("region", name="Text (chat)")
    text.get_by_text("KV blocks used").wait_for()
    info = client.model_info()
    assert info.model_name in text.text_content() and "SERVING" in text.text_content()
    assert f"of {info.kv_blocks_total}" in text.text_content()
    for name in ("GAN", "VAE", "Diffusion"):
        assert "SERVING" in page.get_by_role("region", name=name).text_content()
    assert "32x32" in page.get_by_role("region", name="Diffusion").text_content()
    assert_fits_a_phone(page)
    # Live: an answer in flight shows in the next refreshes (KV blocks held, one request running), then leaves.
    idle = f"0 of {info.kv_blocks_total}"
    kv, running = text.locator("dd", has_text=f" of {info.kv_blocks_total}"), text.locator("dt:text-is('running') + dd")
    body = {"model": "text", "messages": [{"role": "user", "content": "Tell a long story"}], "stream": True,
            "max_tokens": min(1024, info.max_context - 64),
            "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": LONG_ANSWER}}}
    with httpx.Client(base_url=stack.http_url, timeout=60) as http, \
            http.stream("POST", "/chat/completions", json=body) as response:
        lines = response.iter_lines()  # kept: closing it would close the stream
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        expect(kv).not_to_have_text(idle, timeout=LIVE_MS)
        expect(running).to_have_text("1", timeout=LIVE_MS)
    expect(kv).to_have_text(idle, timeout=LIVE_MS)  # the closed stream freed its blocks
    screenshot(page, "models")
