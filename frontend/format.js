// How numbers read on the page: one place, so that every panel says the same thing the same way.

const integer = new Intl.NumberFormat("en");

export function count(n) {
  return integer.format(Math.round(n));
}

/** Seconds of video, e.g. "9.0 s"; minutes past one, e.g. "1:05.0". */
export function videoTime(seconds) {
  if (seconds < 60) return `${seconds.toFixed(1)} s`;
  const minutes = Math.floor(seconds / 60);
  return `${minutes}:${(seconds - 60 * minutes).toFixed(1).padStart(4, "0")}`;
}

const TICK_STEPS_S = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200];

/** Seconds between the ticks of a time axis `total_s` long, for at most `max` ticks. */
export function tickStep(total_s, max) {
  return TICK_STEPS_S.find((s) => total_s / s <= max) ?? TICK_STEPS_S[TICK_STEPS_S.length - 1];
}

/** A short tick label on a time axis: "0 s", "45 s", "2:30". */
export function tick(seconds) {
  if (seconds < 60) return `${Math.round(seconds)} s`;
  const minutes = Math.floor(seconds / 60);
  return `${minutes}:${String(Math.round(seconds - 60 * minutes)).padStart(2, "0")}`;
}

/** Whole seconds as a clock: "0:04", "1:05", "1:02:03". */
export function clock(seconds) {
  const s = Math.round(seconds);
  const hours = Math.floor(s / 3600);
  const minutes = Math.floor((s % 3600) / 60);
  const mmss = `${hours ? String(minutes).padStart(2, "0") : minutes}:${String(s % 60).padStart(2, "0")}`;
  return hours ? `${hours}:${mmss}` : mmss;
}

/** A moment (seconds since the epoch) as the local time of day: "14:03:09". */
export function timeOfDay(epoch_s) {
  return new Date(epoch_s * 1000).toLocaleTimeString("en-GB");
}

export function bytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(0)} KB`;
  if (n < 1024 ** 3) return `${(n / 1024 ** 2).toFixed(1)} MB`;
  return `${(n / 1024 ** 3).toFixed(2)} GB`;
}

export function milliseconds(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

export function percent(fraction) {
  return `${Math.round(100 * fraction)}%`;
}

/** A sampling rate: "1 frame/s", "2 frames/s". */
export function frameRate(fps) {
  return `${fps} frame${fps === 1 ? "" : "s"}/s`;
}
