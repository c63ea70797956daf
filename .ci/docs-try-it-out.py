#!/usr/bin/env python3
"""The browser test of .ci/steps/80-browser.sh: what a person does on /docs.

Opens BASE_URL/docs in a headless Chromium through WebDriver, authorizes
with the demo token, runs "Try it out" for POST /transfers with a fresh
Idempotency-Key, expects 201, runs it again and expects the replay (the
same transfer, `idempotent-replayed: true`), then opens / and expects to
land on /docs. Every wait is bounded; any miss exits 1 with what was
expected and what the page showed, and the screenshot is saved either way.

    docs-try-it-out.py --base-url http://localhost:PORT --screenshot FILE
"""

import argparse
import json
import re
import signal
import sys
import urllib.request
import uuid
from pathlib import Path

from selenium import webdriver
from selenium.common.exceptions import TimeoutException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

# Long enough for a cold debug build to answer and Swagger UI to render its
# 1.7 MB bundle on a busy CI machine; short enough that a stuck page fails
# the step long before the CI budget.
WAIT_SECS = 20
PAGE_LOAD_SECS = 30

TOKEN_A = "tok_test_A"
TOKEN_B = "tok_test_B"
AMOUNT_MINOR = 10000
BODY = {
    "from": "acc_00001",
    "to": "acc_00002",
    "amount_minor": AMOUNT_MINOR,
    "currency": "USD",
    "description": "docs try it out",
}
OPERATION = "operations-Transfers-createTransfer"


class Failure(Exception):
    pass


def say(message):
    print(f"browser: {message}", flush=True)


def wait(driver, what, condition, scope=None):
    try:
        return WebDriverWait(scope or driver, WAIT_SECS).until(condition)
    except TimeoutException:
        raise Failure(f"timed out after {WAIT_SECS}s waiting for {what}") from None


def visible(driver, what, css, scope=None):
    return wait(
        driver,
        what,
        lambda root: next(
            (e for e in root.find_elements(By.CSS_SELECTOR, css) if e.is_displayed()),
            False,
        ),
        scope,
    )


def replace_text(field, text):
    # Swagger UI's inputs are React-controlled: clear() changes the DOM
    # without React seeing it, so the old value would still be sent.
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.BACKSPACE)
    field.send_keys(text)


def start_browser(binary, driver_path):
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    options.add_argument("--headless=new")
    # Chromium's sandbox cannot start as root, which CI runs as.
    options.add_argument("--no-sandbox")
    # /dev/shm is 64 MB in containers; Chromium crashes when it fills up.
    options.add_argument("--disable-dev-shm-usage")
    # Tall enough that the operation and its response fit one screenshot.
    options.add_argument("--window-size=1400,2600")
    # A proxy from the environment must not stand between the page and
    # the server it came from.
    options.add_argument("--no-proxy-server")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path keeps Selenium Manager from trying to
    # download a driver.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(PAGE_LOAD_SECS)
    driver.set_script_timeout(WAIT_SECS)
    return driver


def wait_for_docs(driver):
    title = visible(driver, "Swagger UI to render the spec's title", ".swagger-ui .info .title")
    if "nexo-transfers" not in title.text:
        raise Failure(f"the docs page's title is {title.text!r}, not nexo-transfers")


def authorize(driver):
    visible(driver, "the Authorize button", ".auth-wrapper .btn.authorize").click()
    field = visible(driver, "the bearer token field", "#auth-bearer-value")
    field.send_keys(TOKEN_A)
    visible(driver, "the dialog's Authorize button", ".modal-ux .auth-btn-wrapper .authorize").click()
    visible(driver, "the dialog's Close button", ".modal-ux .btn-done").click()
    wait(
        driver,
        "the Authorize button to show the lock",
        lambda d: d.find_elements(By.CSS_SELECTOR, ".auth-wrapper .btn.authorize.locked"),
    )
    say(f"authorized as {TOKEN_A}")


def fill_create_transfer(driver, key):
    op = visible(driver, "the POST /transfers operation", f"#{OPERATION}")
    op.find_element(By.CSS_SELECTOR, ".opblock-summary-control").click()
    visible(driver, "the Try it out button", ".try-out__btn", op).click()
    key_field = visible(
        driver, "the Idempotency-Key field", 'tr[data-param-name="Idempotency-Key"] input', op
    )
    replace_text(key_field, key)
    body_field = visible(
        driver, "the request body editor", ".opblock-section-request-body textarea.body-param__text", op
    )
    replace_text(body_field, json.dumps(BODY))
    if key_field.get_attribute("value") != key:
        raise Failure(f"the Idempotency-Key field holds {key_field.get_attribute('value')!r}")
    if json.loads(body_field.get_attribute("value")) != BODY:
        raise Failure(f"the body editor holds {body_field.get_attribute('value')!r}")
    return op


def execute(driver, op, base_url):
    """Clicks Execute and returns (status, response headers text, body)."""
    visible(driver, "the Execute button", "button.execute", op).click()
    status_cell = visible(
        driver, "the response to Execute", ".live-responses-table tr.response .response-col_status", op
    )
    status = status_cell.text.strip()
    request_url = op.find_element(By.CSS_SELECTOR, ".request-url pre").text.strip()
    if request_url != f"{base_url}/transfers":
        raise Failure(
            f"Swagger UI sent the request to {request_url}, not to the page's own origin "
            f"{base_url}/transfers"
        )
    responses = op.find_element(By.CSS_SELECTOR, ".live-responses-table")
    headers = responses.find_element(
        By.XPATH, ".//h5[normalize-space()='Response headers']/following-sibling::pre"
    ).text
    body_text = responses.find_element(
        By.XPATH, ".//h5[normalize-space()='Response body']/following-sibling::*[1]//pre"
    ).text
    try:
        body = json.loads(body_text)
    except ValueError:
        raise Failure(f"the rendered response body is not JSON: {body_text[:500]!r}") from None
    return status, headers, body


def clear_response(driver, op):
    old = op.find_element(By.CSS_SELECTOR, ".live-responses-table")
    visible(driver, "the Clear button", "button.btn-clear", op).click()
    wait(driver, "the previous response to be cleared", ec.staleness_of(old))


def replayed(headers):
    return re.search(r"^\s*idempotent-replayed:\s*true\s*$", headers, re.I | re.M) is not None


def check_try_it_out(driver, base_url):
    key = str(uuid.uuid4())
    op = fill_create_transfer(driver, key)
    say(f"POST /transfers with Idempotency-Key {key}")

    status, headers, first = execute(driver, op, base_url)
    if status != "201":
        raise Failure(f"the first Execute showed {status}, not 201: {json.dumps(first)[:500]}")
    if replayed(headers):
        raise Failure(f"the first Execute is marked as a replay:\n{headers}")
    transfer_id = first.get("transfer_id")
    say(f"201, transfer {transfer_id}")

    clear_response(driver, op)
    status, headers, second = execute(driver, op, base_url)
    if status != "201":
        raise Failure(f"the second Execute showed {status}, not 201: {json.dumps(second)[:500]}")
    if not replayed(headers):
        raise Failure(f"the second Execute shows no idempotent-replayed: true:\n{headers}")
    if second != first:
        raise Failure(f"the replay's body differs:\nfirst:  {first}\nsecond: {second}")
    say(f"201 again, idempotent-replayed: true, same transfer {transfer_id}")
    driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", op)


def check_ledger(base_url):
    # The page says "replayed"; the ledger says whether money moved once.
    request = urllib.request.Request(
        f"{base_url}/accounts/{BODY['to']}", headers={"Authorization": f"Bearer {TOKEN_B}"}
    )
    with urllib.request.urlopen(request, timeout=WAIT_SECS) as response:
        balance = json.load(response)["balance_minor"]
    if balance != AMOUNT_MINOR:
        raise Failure(f"{BODY['to']} holds {balance} minor units, not {AMOUNT_MINOR}: not moved once")
    say(f"{BODY['to']} was credited once ({balance})")


def check_root_redirect(driver, base_url):
    driver.get(f"{base_url}/")
    wait(
        driver,
        f"{base_url}/ to land on {base_url}/docs",
        lambda d: d.current_url.split("#")[0] == f"{base_url}/docs",
    )
    wait_for_docs(driver)
    say("GET / landed on /docs")


def csp_violations(driver):
    try:
        entries = driver.get_log("browser")
    except WebDriverException:
        return []
    for entry in entries:
        if entry.get("level") == "SEVERE":
            say(f"console: {entry.get('message')}")
    return [e["message"] for e in entries if "Content Security Policy" in e.get("message", "")]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True, help="http://localhost:PORT")
    parser.add_argument("--screenshot", required=True, type=Path)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    args = parser.parse_args()
    base_url = args.base_url.rstrip("/")
    args.screenshot.parent.mkdir(parents=True, exist_ok=True)

    # The step's timeout sends SIGTERM: quit the browser on the way out
    # rather than leave Chromium and its driver running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("browser test FAILED: timed out"))
    driver = start_browser(args.chromium, args.chromedriver)
    failure = None
    try:
        driver.get(f"{base_url}/docs")
        wait_for_docs(driver)
        say(f"{base_url}/docs rendered")
        authorize(driver)
        check_try_it_out(driver, base_url)
        driver.save_screenshot(str(args.screenshot))
        violations = csp_violations(driver)
        if violations:
            raise Failure("the page broke its Content-Security-Policy:\n" + "\n".join(violations))
        check_ledger(base_url)
        check_root_redirect(driver, base_url)
    except (Failure, WebDriverException, OSError) as error:
        failure = error
        try:
            driver.save_screenshot(str(args.screenshot))
        except WebDriverException:
            pass
        csp_violations(driver)
    finally:
        driver.quit()

    if failure is not None:
        print(f"browser test FAILED: {failure}", file=sys.stderr)
        print(f"the page at the failure: {args.screenshot}", file=sys.stderr)
        return 1
    say(f"passed; screenshot in {args.screenshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
