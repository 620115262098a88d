"""With no MODEL configured (as `make run` starts it), the service runs `streamvqa-demo`, a real
vision-language model, and says what the sample video shows."""

from tests.support import Client, needs_demo, running_stack, sample_video

CYCLES_OR_STREETS = ("cycle", "bike", "moped", "rickshaw", "scooter", "street", "road")


@needs_demo
def test_an_unconfigured_service_names_the_bikes_in_bikes_mp4(redis_url, tmp_path):
    with running_stack(redis_url, tmp_path, MODEL=None) as stack:
        user = Client(stack.url)
        models = user.http.get("/models").json()
        assert models["default"] == "streamvqa-demo"
        assert [m["name"] for m in models["models"]] == ["streamvqa-demo"]
        assert user.create().json()["session"]["model"] == "streamvqa-demo"
        assert user.upload(sample_video("bikes.mp4").read_bytes()).status_code == 202
        session = user.wait_for_state("ingested", "error", timeout_s=120)
        assert (session["state"], session["frames_ingested"]) == ("ingested", 10)  # 10 s at 1 fps
        answer = user.ask("What do you see?").json()["answer"]
        assert any(word in answer.lower() for word in CYCLES_OR_STREETS), answer
        user.delete()
