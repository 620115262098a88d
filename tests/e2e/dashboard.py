"""Steps of the dashboard's browser tests, as a user takes them (tests/e2e/conftest.py has the page)."""

from pathlib import Path

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def create_session(
    page,
    policy: str | None = None,
    budget: int | None = None,
    fps: float | None = None,
    recall: bool | None = None,
    host_budget: int | None = None,
) -> None:
    page.wait_for_selector("#model option[value='tiny-random-llava']", state="attached")
    if policy:
        page.select_option("#policy", policy)
    if budget:
        page.fill("#budget", str(budget))
    if fps:
        page.fill("#fps", str(fps))
    if recall is not None:
        page.get_by_label("Recall").set_checked(recall)
    if host_budget:
        page.fill("#host-budget", str(host_budget))
    page.get_by_role("button", name="Create session").click()
    page.wait_for_selector("#session-line:has-text('Session ')")
    page.wait_for_selector("#connection[data-state='live']")


def upload(page, path: Path) -> None:
    page.set_input_files("#file", str(path))
    page.get_by_role("button", name="Upload").click()


def field(page, name: str) -> str:
    return page.text_content(f"#status [data-field='{name}']")
