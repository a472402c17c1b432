"""The live view in a real browser: headless Chromium (Debian's ``chromium`` package, or the one
``$PARROT_CHROMIUM`` names) driven by Playwright opens ``/ui``, finds a chain's DAG and sees its steps turn
done; the cluster token's holder picks the session from the list; a wrong token sees nothing. Skipped where
there is no browser (CI). ``PARROT_UI_SCREENSHOT=path.png`` saves the finished view (the README's picture).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator

import parrot as P
import pytest

from server.engine import EngineConfig
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig
from tests.server.test_live_view import SUMMARISE, _chain

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = os.environ.get("PARROT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (apt install chromium)")


@pytest.fixture(scope="module")
def server() -> Iterator[LaunchedServer]:
    """Two engines; steps run only when a get reaches them, so the view sees them wait first (counted, not
    timed: nothing has run before the get)."""
    config = ManagerConfig(dispatch="lazy")
    with launch("tiny", engines=2, manager_config=config, engine_config=EngineConfig(num_kv_blocks=256)) as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def test_a_chain_is_seen_waiting_then_done(server: LaunchedServer, browser: object) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 720})  # type: ignore[attr-defined]
    expect = sync_api.expect
    with P.Session(server.url) as session:
        _, _, summary = _chain(session)
        session.flush()
        page.goto(session.view_url)
        steps = page.locator("[data-step]")
        expect(steps).to_have_count(4)
        expect(page.locator("[data-step][data-state=waiting]")).to_have_count(4)
        expect(page.locator("#cluster")).to_be_hidden()  # a session's token sees its session only
        getter = threading.Thread(target=summary.get)
        getter.start()
        expect(page.locator("[data-step][data-state=done]")).to_have_count(4, timeout=60_000)
        getter.join()
        expect(page.locator("#dag-totals")).to_contain_text("4 steps (4 done)")
        page.locator(f"[data-var='{summary.var_id}']").click()
        expect(page.locator("#details-text")).to_have_text(summary.get())
        page.locator("[data-step]").first.click()
        expect(page.locator("#details-fields")).to_contain_text("saved by sharing")
        if os.environ.get("PARROT_UI_SCREENSHOT"):
            page.screenshot(path=os.environ["PARROT_UI_SCREENSHOT"], full_page=True)
    page.close()


def test_the_operator_picks_a_session_and_a_wrong_token_sees_nothing(
    server: LaunchedServer, browser: object
) -> None:
    page = browser.new_page()  # type: ignore[attr-defined]
    expect = sync_api.expect
    with P.Session(server.url) as session:
        answer = SUMMARISE(a="short", b="long", c="odd")
        answer.get()
        page.goto(f"{server.url}/ui#token={server.cluster_token}")
        expect(page.locator("#engines tbody tr")).to_have_count(2)
        page.locator(f"#sessions tr[data-session='{session.session_id}']").click()
        expect(page.locator("[data-step][data-state=done]")).to_have_count(1)
        assert page.url.endswith("/ui")  # the token left the address bar
        wrong = browser.new_page()  # type: ignore[attr-defined]
        wrong.goto(f"{server.url}/ui#token=guess&session={session.session_id}")
        expect(wrong.locator("#status")).to_contain_text("wrong token")
        expect(wrong.locator("[data-step]")).to_have_count(0)
        expect(wrong.locator("#engines tbody tr")).to_have_count(0)
        wrong.close()
    page.close()
