// The playground of `runtime serve` (runtime/pages.py): a client of the server's own API, as
// the openai SDK is. Plain script, no build step and nothing from outside the server.
"use strict";

const KEY = "wan-api-key"; // sessionStorage: this tab only
const PAGE = 6; // videos a gallery page
const POLL_MS = 250; // a video in progress is asked for this often
const MAX_CROP = 0.5; // runtime.generation.images.MAX_CROP: the server refuses an image cropped more
const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

let models = []; // GET /v1/models: each with `served`, what a request may ask of it
let picture = null; // the chosen image, decoded
let following = null; // the id of the video whose progress is shown
const cursors = [null]; // the gallery's pages: page i lists the videos after cursors[i]
let pageIndex = 0;
let galleryUrls = []; // thumbnails' blob: URLs, released when the page is drawn again
let playerUrls = [];

class ServerError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// A request to the API with the tab's key; an error answer throws the server's own message,
// and a 401 asks for a key.
async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = sessionStorage.getItem(KEY);
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const answer = await fetch(path, { ...options, headers });
  if (answer.ok) return answer;
  let message = `${answer.status} ${answer.statusText}`;
  try {
    message = (await answer.json()).error.message;
  } catch {
    // not the server's error object: its status says what there is to say
  }
  if (answer.status === 401) askKey(message);
  throw new ServerError(answer.status, message);
}

const json = async (path, options) => (await api(path, options)).json();

function askKey(message) {
  sessionStorage.removeItem(KEY);
  for (const id of ["create-panel", "job-panel", "player-panel", "gallery-panel"]) $(id).hidden = true;
  $("forget-key").hidden = true;
  $("key-error").textContent = message;
  $("key-panel").hidden = false;
  $("key-input").focus();
}

async function start() {
  try {
    models = (await json("/v1/models")).data;
  } catch (e) {
    if (e.status !== 401) $("served").textContent = e.message;
    return;
  }
  $("key-panel").hidden = true;
  $("forget-key").hidden = !sessionStorage.getItem(KEY);
  $("served").textContent = models.map(describeModel).join("; ");
  fill($("model"), models.map((m) => [m.id, m.id]));
  chooseModel();
  $("create-panel").hidden = false;
  $("gallery-panel").hidden = false;
  await showGallery();
}

function describeModel(model) {
  const sizes = unique(model.served.map((s) => s.size));
  const kinds = unique(model.served.map((s) => (s.image ? "image to video" : "text to video")));
  return `${model.id}: ${kinds.join(" and ")} at ${sizes.join(", ")}`;
}

const unique = (values) => [...new Set(values)];

function fill(select, options) {
  const kept = select.value;
  select.replaceChildren(
    ...options.map(([value, label]) => {
      const option = document.createElement("option");
      option.value = value;
      option.textContent = label;
      return option;
    }),
  );
  if (options.some(([value]) => value === kept)) select.value = kept;
}

const model = () => models.find((m) => m.id === $("model").value);

function chooseModel() {
  fill($("size"), unique(model().served.map((s) => s.size)).map((size) => [size, size]));
  chooseSize();
}

function chooseSize() {
  const lengths = model().served.filter((s) => s.size === $("size").value);
  const seen = new Map(lengths.map((s) => [String(s.frames), `${s.seconds} s (${s.frames} frames)`]));
  fill($("length"), [...seen]);
  chooseLength();
}

// The builds that serve the chosen model, size and length: with or without an image, with or
// without CFG.
const builds = () =>
  model().served.filter((s) => s.size === $("size").value && String(s.frames) === $("length").value);

function chooseLength() {
  const served = builds();
  const images = unique(served.map((s) => s.image));
  $("image-field").hidden = !images.includes(true);
  $("image-legend").textContent = images.includes(false)
    ? "Image: the first frame (optional: with one, image to video)"
    : "Image: the first frame (required)";
  $("image").required = !images.includes(false);
  const cfg = unique(served.map((s) => s.cfg));
  const guidance = $("guidance");
  if (cfg.length === 1 && cfg[0] && Number(guidance.value) <= 1) guidance.value = 5;
  if (cfg.length === 1 && !cfg[0] && Number(guidance.value) > 1) guidance.value = 1;
  $("guidance-note").textContent =
    cfg.length === 2
      ? "Guidance above 1 runs with CFG (a negative prompt); 1 or less without."
      : cfg[0]
        ? "This size is built with CFG: guidance above 1."
        : "This size is built without CFG: guidance 1 or less.";
  drawCrop();
}

// runtime.generation.images.condition_pixels: the image resized to cover the video's size, keeping its
// aspect ratio, and the middle kept; in the image's own pixels.
function crop(w, h, width, height) {
  const ratio = width / height;
  const wider = ratio > w / h; // the video is wider than the image: rows are cropped
  const keptW = wider ? w : h * ratio;
  const keptH = wider ? w / ratio : h;
  const discarded = 1 - Math.min(ratio, w / h) / Math.max(ratio, w / h);
  return { x: (w - keptW) / 2, y: (h - keptH) / 2, w: keptW, h: keptH, discarded };
}

function drawCrop() {
  const note = $("crop-note");
  $("crop").hidden = !picture || $("image-field").hidden;
  note.textContent = "";
  note.classList.remove("error");
  if (!picture || $("image-field").hidden) return;
  const [width, height] = $("size").value.split("x").map(Number);
  const { width: w, height: h } = picture;
  const box = crop(w, h, width, height);
  const percent = Math.round(100 * box.discarded);
  if (box.discarded > MAX_CROP) {
    note.classList.add("error");
    note.textContent =
      `The server will refuse this ${w}x${h} image: fitting it to ${width}x${height} crops ` +
      `${percent}% of it away (more than ${100 * MAX_CROP}%).`;
  } else {
    note.textContent =
      `The server keeps ${Math.round(box.w)}x${Math.round(box.h)} of this ${w}x${h} image, ` +
      `about its centre (${percent}% cropped away), and resizes it to ${width}x${height}.`;
  }
  const whole = $("crop-whole");
  const scale = Math.min(320 / w, 240 / h);
  whole.width = Math.round(w * scale);
  whole.height = Math.round(h * scale);
  const g = whole.getContext("2d");
  g.drawImage(picture, 0, 0, whole.width, whole.height);
  g.fillStyle = "rgba(0, 0, 0, 0.6)"; // what is cropped away, dimmed
  g.beginPath();
  g.rect(0, 0, whole.width, whole.height);
  g.rect(box.x * scale, box.y * scale, box.w * scale, box.h * scale);
  g.fill("evenodd");
  g.strokeStyle = "#ffd400";
  g.strokeRect(box.x * scale, box.y * scale, box.w * scale, box.h * scale);
  const frame = $("crop-frame");
  frame.width = width;
  frame.height = height;
  const f = frame.getContext("2d");
  f.imageSmoothingQuality = "high";
  f.drawImage(picture, box.x, box.y, box.w, box.h, 0, 0, width, height);
}

async function chooseImage() {
  const file = $("image").files[0];
  picture = null;
  if (file) {
    try {
      picture = await createImageBitmap(file);
    } catch {
      $("crop-note").textContent = `This browser cannot show ${file.name}; the server will say what it makes of it.`;
      $("crop").hidden = true;
      return;
    }
  }
  drawCrop();
}

async function submit(event) {
  event.preventDefault();
  const form = new FormData();
  const served = builds()[0];
  form.set("prompt", $("prompt").value);
  if ($("negative-prompt").value) form.set("negative_prompt", $("negative-prompt").value);
  form.set("model", $("model").value);
  form.set("size", $("size").value);
  form.set("seconds", served.seconds);
  form.set("steps", $("steps").value);
  form.set("guidance", $("guidance").value);
  if (!$("random-seed").checked) form.set("seed", $("seed").value);
  const file = $("image-field").hidden ? undefined : $("image").files[0];
  if (file) form.set("input_reference", file, file.name);
  $("create-error").textContent = "";
  $("submit").disabled = true;
  try {
    const video = await json("/v1/videos", { method: "POST", body: form });
    if (pageIndex === 0) showGallery();
    follow(video);
  } catch (e) {
    $("create-error").textContent = e.message;
  } finally {
    $("submit").disabled = false;
  }
}

// A video's progress, asked for every POLL_MS until it is done; then it plays.
async function follow(video) {
  following = video.id;
  const samples = []; // [time, progress] once the steps run: the estimate's rate
  $("job-panel").hidden = false;
  for (;;) {
    showProgress(video, samples);
    if (video.status === "completed") {
      await play(video);
      showGallery();
      return;
    }
    if (video.status === "failed") {
      showGallery();
      return;
    }
    await sleep(POLL_MS);
    if (following !== video.id) return; // another video is followed now
    try {
      video = await json(`/v1/videos/${video.id}`);
    } catch (e) {
      $("progress-text").textContent = e.message;
      return;
    }
  }
}

function showProgress(video, samples) {
  const text = $("progress-text");
  $("progress").value = video.progress;
  text.classList.toggle("error", video.status === "failed");
  // The server keeps progress as a whole percent of the steps: exact for up to 100 steps.
  const done = Math.min(video.steps, Math.ceil((video.progress * video.steps) / 100));
  if (video.status === "queued") {
    text.textContent = `${video.id}: queued`;
  } else if (video.status === "in_progress") {
    if (video.progress > 0) samples.push([performance.now(), video.progress]);
    let left = "estimating the time left";
    if (samples.length > 1 && samples.at(-1)[1] > samples[0][1]) {
      const [[t0, p0], [t1, p1]] = [samples[0], samples.at(-1)];
      const seconds = ((100 - p1) * (t1 - t0)) / (p1 - p0) / 1000;
      left = `about ${seconds < 10 ? seconds.toFixed(1) : Math.round(seconds)} s left`;
    }
    text.textContent = `${video.id}: step ${done} of ${video.steps} (${video.progress}%), ${left}`;
  } else if (video.status === "completed") {
    const took = video.completed_at - video.created_at;
    text.textContent = `${video.id}: done, ${video.steps} of ${video.steps} steps in about ${took} s`;
  } else {
    text.textContent = `${video.id}: failed: ${video.error ? video.error.message : "no reason given"}`;
  }
}

const content = async (id, variant) =>
  URL.createObjectURL(await (await api(`/v1/videos/${id}/content?variant=${variant}`)).blob());

async function play(video) {
  let urls;
  try {
    urls = await Promise.all(["video", "thumbnail", "spritesheet"].map((v) => content(video.id, v)));
  } catch (e) {
    $("progress-text").textContent = e.message;
    return;
  }
  playerUrls.forEach(URL.revokeObjectURL);
  playerUrls = urls;
  const [mp4, thumbnail, spritesheet] = urls;
  const player = $("player");
  player.src = mp4;
  player.dataset.id = video.id;
  $("download").href = mp4;
  $("download").download = `${video.id}.mp4`;
  $("thumbnail").src = thumbnail;
  $("spritesheet").src = spritesheet;
  $("player-settings").textContent = `${video.prompt} (${settings(video)})`;
  $("player-panel").hidden = false;
  player.play().catch(() => {}); // muted: a page may start it; else the controls do
}

function settings(video) {
  const parts = [
    video.model,
    video.size,
    `${video.seconds} s (${video.frames} frames)`,
    `${video.steps} steps`,
    `guidance ${video.guidance}`,
    `seed ${video.seed}`,
  ];
  if (video.input_reference) parts.push("from an image");
  if (video.negative_prompt) parts.push(`not: ${video.negative_prompt}`);
  return parts.join(", ");
}

async function showGallery() {
  const query = new URLSearchParams({ limit: PAGE });
  if (cursors[pageIndex]) query.set("after", cursors[pageIndex]);
  let page;
  try {
    page = await json(`/v1/videos?${query}`);
  } catch (e) {
    if (e.status === 404 && pageIndex > 0) {
      // the video the page started after was deleted: start again from the newest
      cursors.length = 1;
      pageIndex = 0;
      return showGallery();
    }
    $("gallery-error").textContent = e.message;
    return;
  }
  $("gallery-error").textContent = "";
  galleryUrls.forEach(URL.revokeObjectURL);
  galleryUrls = [];
  $("gallery").replaceChildren(...page.data.map(galleryItem));
  cursors.length = pageIndex + 1;
  if (page.has_more) cursors.push(page.last_id);
  $("older").disabled = !page.has_more;
  $("newer").disabled = pageIndex === 0;
  $("page-number").textContent = `page ${pageIndex + 1}`;
}

function galleryItem(video) {
  const item = document.createElement("li");
  item.dataset.id = video.id;
  const image = document.createElement(video.status === "completed" ? "img" : "span");
  image.className = "thumbnail";
  if (video.status === "completed") {
    image.alt = "thumbnail";
    content(video.id, "thumbnail")
      .then((url) => {
        galleryUrls.push(url);
        image.src = url;
      })
      .catch(() => {}); // its file gone: the item still says what it was
  }
  const about = document.createElement("div");
  const prompt = document.createElement("strong");
  prompt.textContent = video.prompt;
  const detail = document.createElement("p");
  detail.textContent = settings(video);
  const status = document.createElement("p");
  status.className = video.status === "failed" ? "status error" : "status";
  const when = new Date(1000 * (video.completed_at || video.created_at)).toLocaleString();
  status.textContent =
    video.status === "failed"
      ? `failed: ${video.error ? video.error.message : "no reason given"}`
      : video.status === "in_progress"
        ? `in progress, ${video.progress}%`
        : `${video.status.replace("_", " ")} ${when}`;
  about.append(prompt, detail, status);
  const actions = document.createElement("div");
  if (video.status === "completed") actions.append(button("Show", () => play(video)));
  actions.append(button("Delete", () => remove(video)));
  item.append(image, about, actions);
  return item;
}

function button(label, action) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.addEventListener("click", action);
  return b;
}

async function remove(video) {
  if (!confirm(`Delete the video "${video.prompt}"?`)) return;
  try {
    await api(`/v1/videos/${video.id}`, { method: "DELETE" });
  } catch (e) {
    $("gallery-error").textContent = e.message;
    return;
  }
  if ($("player").dataset.id === video.id) $("player-panel").hidden = true;
  showGallery();
}

function page(step) {
  pageIndex += step;
  showGallery();
}

document.addEventListener("DOMContentLoaded", () => {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("key-input").value.trim());
    $("key-input").value = "";
    start();
  });
  $("forget-key").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    location.reload();
  });
  $("model").addEventListener("change", chooseModel);
  $("size").addEventListener("change", chooseSize);
  $("length").addEventListener("change", chooseLength);
  $("image").addEventListener("change", chooseImage);
  $("clear-image").addEventListener("click", () => {
    $("image").value = "";
    chooseImage();
  });
  $("random-seed").addEventListener("change", () => {
    $("seed").disabled = $("random-seed").checked;
  });
  $("create-form").addEventListener("submit", submit);
  $("newer").addEventListener("click", () => page(-1));
  $("older").addEventListener("click", () => page(1));
  start();
});
