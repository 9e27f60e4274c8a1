"""Drives Debian's chromium through sluice's console (`/ui`) with Selenium, as an operator would,
for the tests of tests/embedded_slow/console.rs: each scenario asserts what the page shows and
exits 1 saying why when it does not. Traffic comes through the admin port's `/json`, which
decides and counts requests as the gRPC service does.

    console.py SCENARIO --admin 127.0.0.1:PORT [--token TOKEN]
"""

import argparse
import json
import shutil
import sys
import time
import urllib.error
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

# The rule file the tests start sluice with: `k` admits 2 requests an hour.
DOMAIN = "web"
SCRIPT_VALUE = "<script>window.pwned = 'script'</script>"
IMAGE_VALUE = "<img src=x onerror=\"window.pwned = 'image'\">"


def request(value):
    return {"domain": DOMAIN, "descriptors": [{"entries": [{"key": "k", "value": value}]}]}


def decide(admin, token, value):
    """POSTs a request for `value` to /json: the HTTP status (200 OK, 429 over the limit)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + token
    asked = urllib.request.Request(f"http://{admin}/json", json.dumps(request(value)).encode(),
                                   headers)
    try:
        with urllib.request.urlopen(asked, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code


def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1400"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def until(what, check, seconds=15):
    """`check()`'s value once it is true; fails naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            value = check()
        except Exception:  # an element replaced while read: read again
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds} s for {what}")
        time.sleep(0.1)


def text(page, selector):
    return page.find_element(By.CSS_SELECTOR, selector).text


def rows(page, table):
    return page.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")


def enter_token(page, token):
    until("the token form", lambda: page.find_element(By.ID, "token-form").is_displayed())
    field = page.find_element(By.ID, "token")
    field.clear()
    field.send_keys(token)
    page.find_element(By.CSS_SELECTOR, "#token-form button").click()


def fill(page, field, value):
    element = page.find_element(By.ID, field)
    element.clear()
    element.send_keys(value)


def updates(page, admin, token):
    """The page loads with no traffic, then shows the rule and the rate as traffic comes."""
    until("the first update", lambda: text(page, "#state").startswith("updated"))
    assert not rows(page, "rules-hit"), "a rule hit before any traffic"
    for _ in range(5):
        decide(admin, token, "steady")
    until("the rule among the most hit", lambda: any(
        r.text.startswith(DOMAIN + " k ") for r in rows(page, "rules-hit")))
    until("a decision rate", lambda: float(text(page, "#rate")) > 0)
    until("the value among the most denied", lambda: "k=steady" in text(page, "#values-denied"))
    assert "memory" in text(page, "#store-status"), text(page, "#store-status")
    assert "k" in text(page, "#rules-list"), text(page, "#rules-list")


def explains(page, admin, token):
    """The form sends a request to /explain and shows its answer."""
    until("the first update", lambda: text(page, "#state").startswith("updated"))
    fill(page, "explain-request", json.dumps(request("why")))
    page.find_element(By.CSS_SELECTOR, "#explain-form button").click()
    answer = until("the explanation", lambda: text(page, "#explain-answer"))
    assert answer.startswith("200"), answer
    assert '"known_domain": true' in answer and "rules.yaml:3" in answer, answer


def resets(page, admin, token):
    """A counter over its limit is reset from the page: its dry run first, which changes
    nothing, then applied, after which the request is admitted again."""
    enter_token(page, token)
    until("the first update", lambda: text(page, "#state").startswith("updated"))
    statuses = [decide(admin, token, "locked") for _ in range(3)]
    assert statuses == [200, 200, 429], statuses
    fill(page, "counters-request", json.dumps(request("locked")))
    Select(page.find_element(By.ID, "counters-action")).select_by_value("reset")
    apply = page.find_element(By.ID, "counters-apply")
    assert not apply.is_enabled(), "Apply before a dry run"
    page.find_element(By.ID, "counters-dry-run").click()
    answer = until("the dry run", lambda: text(page, "#counters-answer"))
    assert answer.startswith("200") and '"applied": false' in answer, answer
    until("Apply, once the dry run is shown", apply.is_enabled)
    assert decide(admin, token, "locked") == 429, "the dry run changed the counter"
    apply.click()
    until("the change", lambda: '"applied": true' in text(page, "#counters-answer"))
    assert decide(admin, token, "locked") == 200, "still over the limit after the reset"


def hostile(page, admin, token):
    """Values that are markup are shown as their characters, and nothing of them runs."""
    for value in (SCRIPT_VALUE, IMAGE_VALUE):
        for _ in range(3):
            decide(admin, token, value)
    shown = until("the hostile values", lambda: (
        lambda t: SCRIPT_VALUE in t and IMAGE_VALUE in t and t)(text(page, "#values-denied")))
    assert "k=" + SCRIPT_VALUE in shown, shown
    time.sleep(1.5)
    ran = page.execute_script("return window.pwned === undefined ? null : window.pwned")
    assert ran is None, f"a value ran: {ran}"
    planted = page.execute_script("return document.querySelectorAll('main img, main script').length")
    assert planted == 0, f"{planted} element(s) made of a value"


def refuses(page, admin, token):
    """Without the token the page shows nothing and changes nothing; a wrong one is refused;
    the right one shows the data. Each refusal makes the port wait a second for this client
    (429 meanwhile), which the pauses wait out."""
    until("the token form", lambda: page.find_element(By.ID, "token-form").is_displayed())
    assert "token" in text(page, "#state"), text(page, "#state")
    assert not rows(page, "values-denied") and not text(page, "#store-status")
    time.sleep(1.2)
    statuses = [decide(admin, token, "locked") for _ in range(3)]
    assert statuses == [200, 200, 429], statuses
    status = page.execute_async_script("""
        const done = arguments[arguments.length - 1];
        fetch('/counters', {method: 'POST', headers: {'Content-Type': 'application/json'},
            body: JSON.stringify({...arguments[0], action: 'reset', apply: true})})
          .then((r) => done(r.status), () => done(0));
    """, request("locked"))
    assert status == 401, f"/counters without the token answered {status}"
    time.sleep(1.2)
    assert decide(admin, token, "locked") == 429, "a reset without the token freed the counter"
    enter_token(page, "not-the-token")
    until("the refusal of a wrong token", lambda: page.find_element(By.ID, "token-form").is_displayed())
    assert not text(page, "#store-status"), "data shown with a wrong token"
    time.sleep(1.2)
    enter_token(page, token)
    until("the store, with the token", lambda: "memory" in text(page, "#store-status"))


SCENARIOS = {f.__name__: f for f in (updates, explains, resets, hostile, refuses)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--admin", required=True)
    parser.add_argument("--token")
    args = parser.parse_args()
    page = browser()
    try:
        page.get(f"http://{args.admin}/ui")
        SCENARIOS[args.scenario](page, args.admin, args.token)
    except AssertionError as e:
        print(f"{args.scenario}: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        page.quit()
    print(f"{args.scenario}: ok")


if __name__ == "__main__":
    main()
