"""A real headless Chromium driven by Selenium, for the board's end-to-end tests.

Selenium's API blocks, and the server under test runs on the test's event
loop, so every browser call goes through ``asyncio.to_thread``. The browser
runs in a zone of its own (``TZ``), so the tests can see the board's script
turn UTC into the viewer's local time.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import TypeVar

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.wait import WebDriverWait

T = TypeVar("T")

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1360,900",
    "--lang=en-US",
)
#: The viewer's zone in these tests: neither UTC nor any policy's zone.
VIEWER_ZONE = "Europe/Berlin"


def require_browser() -> None:
    """Skips without Chromium and its driver, except in CI, where it fails."""
    if os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK):
        return
    if os.environ.get("CI"):
        pytest.fail("CI must have chromium and chromium-driver (.ci/run installs them)")
    pytest.skip(f"{CHROMIUM} or {CHROMEDRIVER} missing: apt-get install chromium chromium-driver")


class Browser:
    """One headless Chromium with a fresh profile, pointed at a base URL."""

    def __init__(self, base_url: str, profile: pathlib.Path) -> None:
        self.base_url = base_url
        self._profile = profile
        options = Options()
        options.binary_location = CHROMIUM
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={profile}")
        service = Service(executable_path=CHROMEDRIVER, env={**os.environ, "TZ": VIEWER_ZONE})
        self.driver = webdriver.Chrome(options=options, service=service)

    @classmethod
    async def start(cls, base_url: str, profile: pathlib.Path) -> Browser:
        """Starts a browser."""
        return await asyncio.to_thread(cls, base_url, profile)

    async def close(self) -> None:
        """Quits the browser and removes its profile."""
        await asyncio.to_thread(self.driver.quit)
        shutil.rmtree(self._profile, ignore_errors=True)

    async def open(self, path: str) -> None:
        """Loads a page of the server."""
        await asyncio.to_thread(self.driver.get, self.base_url + path)

    @property
    def path(self) -> str:
        """The current page's path and query."""
        url: str = self.driver.current_url
        return url.removeprefix(self.base_url)

    def _find(self, css: str) -> WebElement:
        return self.driver.find_element(By.CSS_SELECTOR, css)

    async def text(self, css: str = "body") -> str:
        """The rendered text of the first element matching ``css``."""
        return await asyncio.to_thread(_unstale, lambda: str(self._find(css).text))

    async def texts(self, css: str) -> list[str]:
        """The rendered text of every element matching ``css``."""

        def read() -> list[str]:
            return [str(e.text) for e in self.driver.find_elements(By.CSS_SELECTOR, css)]

        return await asyncio.to_thread(_unstale, read)

    async def exists(self, css: str) -> bool:
        """Whether any element matches ``css``."""
        return bool(
            await asyncio.to_thread(lambda: self.driver.find_elements(By.CSS_SELECTOR, css))
        )

    async def fill(self, css: str, value: str) -> None:
        """Replaces an input's value by typing."""

        def type_in() -> None:
            element = self._find(css)
            element.clear()
            element.send_keys(value)

        await asyncio.to_thread(type_in)

    async def click(self, css: str) -> None:
        """Clicks a link or submit button and waits for the next page to load."""

        def click_and_wait() -> None:
            old = self._find("html")
            self._find(css).click()
            WebDriverWait(self.driver, 15).until(lambda _: _left_the_document(old))
            WebDriverWait(self.driver, 15).until(
                lambda d: d.execute_script("return document.readyState") == "complete"
            )

        await asyncio.to_thread(click_and_wait)

    async def tick(self, css: str) -> None:
        """Clicks a checkbox (or anything else that loads no page)."""
        await asyncio.to_thread(lambda: self._find(css).click())

    async def cookies(self) -> list[dict[str, object]]:
        """The cookies the browser holds for the current page."""
        return await asyncio.to_thread(self.driver.get_cookies)

    async def screenshot(self, path: pathlib.Path, width: int) -> bytes:
        """Saves (and returns) a PNG of the whole page, laid out ``width`` CSS pixels wide."""

        def metrics(height: int) -> None:
            self.driver.execute_cdp_cmd(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            )

        def shoot() -> bytes:
            metrics(600)
            metrics(int(self.driver.execute_script("return document.body.scrollHeight")))
            png: bytes = self.driver.get_screenshot_as_png()
            self.driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
            path.write_bytes(png)
            return png

        return await asyncio.to_thread(shoot)


def _unstale(read: Callable[[], T]) -> T:
    """``read()``, found again when the page's script replaced an element
    between finding it and reading it (the board refreshes its counts)."""
    for _ in range(20):
        try:
            return read()
        except StaleElementReferenceException:
            continue
    return read()


def _left_the_document(element: WebElement) -> bool:
    """Whether a page's element is gone (the next page has replaced it).

    Mid-navigation chromedriver may say so as an "unknown error" ("Node with
    given id does not belong to the document") instead of a stale reference.
    """
    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        if "does not belong to the document" in str(exc):
            return True
        raise
    return False
