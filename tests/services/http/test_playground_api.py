"""The playground's routes without a stack: the page and its files, the bodies' checks, the settings the controls
start from, the live figures read from Ray's metrics text. (In a browser: tests/e2e/test_e2e_playground.py.)"""

from __future__ import annotations

import base64
import io

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image
from pydantic import ValidationError

from genserve.services.common.errors import InvalidArgument
from genserve.services.diffusion.schema import SCHEDULERS, DiffusionIn
from genserve.services.http import playground_api
from genserve.services.text.schema import DEFAULT_MAX_TOKENS, MAX_TOKENS, TextIn


@pytest.fixture(scope="module")
def http() -> TestClient:
    app = FastAPI()
    app.include_router(playground_api.router)
    return TestClient(app)


def test_the_page_and_its_modules_are_served_from_the_package_with_a_strict_policy(http) -> None:
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script type="module" src="/playground/app.js">' in page.text
    for name in ("app.js", "api.js", "chat.js", "images.js", "markdown.js", "models.js", "snippets.js"):
        module = http.get(f"/playground/{name}")
        assert module.status_code == 200 and module.headers["content-type"] == "text/javascript; charset=utf-8"
        assert "http://" not in module.text.replace("http://127.0.0.1", "") and "https://" not in module.text
    assert http.get("/playground/style.css").headers["content-type"] == "text/css; charset=utf-8"


def test_only_the_shipped_files_are_served(http) -> None:
    for name in ("..%2Fapp.py", "playground_api.py", "nothing.js"):
        assert http.get(f"/playground/{name}").status_code == 404
    assert "playground_api.py" not in playground_api.asset_names()


def test_every_module_the_page_imports_ships(http) -> None:
    import re

    names = playground_api.asset_names()
    for name in names:
        if name.endswith(".js"):
            for imported in re.findall(r'from "\./([\w.]+)"', http.get(f"/playground/{name}").text):
                assert imported in names, f"{name} imports {imported}, which is not shipped"


def test_the_settings_are_the_services_own_defaults_and_limits() -> None:
    settings = playground_api.settings()
    assert settings["text"]["temperature"] == {"default": TextIn.model_fields["temperature"].default, "ge": 0, "le": 2}
    assert settings["text"]["max_tokens"] == {"default": DEFAULT_MAX_TOKENS, "ge": 1, "le": MAX_TOKENS}
    assert settings["text"]["top_p"] == {"default": 1.0, "gt": 0, "le": 1}
    assert settings["diffusion"]["steps"]["default"] == DiffusionIn.model_fields["steps"].default
    assert settings["diffusion"]["steps"]["ge"] == 1
    assert settings["diffusion"]["schedulers"] == list(SCHEDULERS)


def test_a_vae_image_must_be_a_base64_png() -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(buffer, format="PNG")
    png = buffer.getvalue()
    assert playground_api.decode_png(base64.b64encode(png).decode()) == png
    assert playground_api.decode_png("data:image/png;base64," + base64.b64encode(png).decode()) == png
    with pytest.raises(InvalidArgument) as bad:
        playground_api.decode_png("not base64!")
    assert bad.value.field == "image"
    with pytest.raises(InvalidArgument, match="not a PNG"):
        playground_api.decode_png(base64.b64encode(b"GIF89a....").decode())


def test_seeds_and_previews_are_checked_where_the_wire_needs_it() -> None:
    with pytest.raises(ValidationError) as bad:
        playground_api.GanSamplesBody.model_validate({"seed": 2**63})
    assert bad.value.errors()[0]["loc"] == ("seed",)
    with pytest.raises(ValidationError):
        playground_api.ImageStreamBody.model_validate({"prompt": "a circle", "preview_every": -1})
    with pytest.raises(ValidationError):  # strict like the OpenAI bodies: no strings for numbers
        playground_api.GanWalkBody.model_validate({"seed_start": "1"})


def test_live_figures_sum_over_replicas_by_application() -> None:
    metrics = "\n".join([
        "# HELP ray_genserve_ongoing_requests Requests being handled by this replica.",
        'ray_genserve_ongoing_requests{service="text",replica="a"} 2.0',
        'ray_genserve_ongoing_requests{service="text",replica="b"} 1.0',
        'ray_genserve_ongoing_requests{service="health"} 5.0',
        'ray_serve_deployment_queued_queries{application="diffusion",deployment="Diffusion"} 3.0',
        'ray_serve_deployment_queued_queries_total{application="text"} 9.0',
    ])
    live = playground_api.parse_metrics(metrics)
    assert live["text"] == {"running": 3.0, "waiting": 0.0}
    assert live["diffusion"] == {"running": 0.0, "waiting": 3.0}
    assert set(live) == {"text", "gan", "vae", "diffusion"}
