"""A headless Chromium for browser tests, driven by selenium (Debian's `chromium` + `chromium-driver`; `make
browser` installs them where apt-get exists)."""

from __future__ import annotations

import shutil

BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


def find_chromium() -> tuple[str, str] | str:
    """(browser binary, chromedriver binary), or the reason none can be used (for pytest.skip)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    browser = next((path for path in map(shutil.which, BROWSER_NAMES) if path), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        return (
            "no Chromium and chromedriver found on PATH: run `make browser` "
            "(apt-get install -y chromium chromium-driver)"
        )
    return browser, driver


FAKE_CAMERA_FLAGS = ("--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream")


def headless_chromium(
    browser: str,
    driver: str,
    user_data_dir: str,
    width: int = 1100,
    height: int = 760,
    extra_flags: tuple[str, ...] = (),
    network_log: bool = False,
):
    """A selenium WebDriver on a fresh headless Chromium profile in `user_data_dir`, with the browser console kept
    (read it with `driver.get_log("browser")`); `extra_flags` go on the command line (FAKE_CAMERA_FLAGS: a test
    pattern as the camera, no permission prompt); `network_log` keeps the DevTools network events, WebSocket frames
    included (read them with `driver.get_log("performance")`)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in CHROMIUM_FLAGS + tuple(extra_flags):
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={user_data_dir}")
    options.add_argument(f"--window-size={width},{height}")
    logs = {"browser": "ALL", "performance": "ALL"} if network_log else {"browser": "ALL"}
    options.set_capability("goog:loggingPrefs", logs)
    return webdriver.Chrome(service=Service(driver), options=options)
