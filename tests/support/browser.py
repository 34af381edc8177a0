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


def headless_chromium(browser: str, driver: str, user_data_dir: str, width: int = 1100, height: int = 760):
    """A selenium WebDriver on a fresh headless Chromium profile in `user_data_dir`, with the browser console kept
    (read it with `driver.get_log("browser")`)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={user_data_dir}")
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)
