// The console's only script (its Content-Security-Policy allows no other): a trajectory that is still running
// follows its run live over server-sent events, swapping in the timeline as each step is stored.
"use strict";

function followLive(timeline) {
  const source = new EventSource(timeline.dataset.live);
  const refresh = async () => {
    const response = await fetch(timeline.dataset.fragment, { credentials: "same-origin" });
    if (!response.ok) return;
    timeline.innerHTML = await response.text();
    // The facts above the timeline say the run's status too: keep them in step with it.
    const now = timeline.querySelector(".timeline-status");
    const facts = document.getElementById("status");
    if (now && facts) facts.innerHTML = now.innerHTML;
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
