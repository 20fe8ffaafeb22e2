// The console's only script (its Content-Security-Policy allows no other): a trajectory that is still running
// follows its run live over server-sent events, swapping in the timeline as each step is stored.
"use strict";

function followLive(timeline) {
  const source = new EventSource(timeline.dataset.live);
  const refresh = async () => {
    const response = await fetch(timeline.dataset.fragment, { credentials: "same-origin" });
    if (response.ok) timeline.innerHTML = await response.text();
  };
  source.addEventListener("step", refresh);
  source.addEventListener("end", async () => {
    source.close();
    await refresh();
    delete timeline.dataset.live;
    timeline.dataset.ended = "true";
  });
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-live]").forEach(followLive);
  document.querySelectorAll("form[data-confirm]").forEach((form) => {
    form.addEventListener("submit", (event) => {
      if (!window.confirm(form.dataset.confirm)) event.preventDefault();
    });
  });
});
