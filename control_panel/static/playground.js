// The playground: sends a chat message to /ui/playground/stream and shows the answer as it
// streams, with the request's route, time to first token, rate and bytes moved. Its form carries
// the route names in the page's language (data-route-labels) and the CSRF token (data-csrf).
(function () {
  const form = document.getElementById("chat"), answer = document.getElementById("answer"),
        err = document.getElementById("answer-error"), send = document.getElementById("send"),
        stop = document.getElementById("stop");
  const routeLabels = JSON.parse(form.dataset.routeLabels);
  let controller = null;
  const set = (id, text) => { document.getElementById(id).textContent = text; };
  stop.addEventListener("click", () => controller && controller.abort());
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    answer.textContent = ""; err.hidden = true;
    for (const id of ["s-route", "s-ttft", "s-tps", "s-bytes", "s-tokens"]) set(id, "…");
    send.disabled = true; stop.hidden = false;
    controller = new AbortController();
    try {
      const res = await fetch("/ui/playground/stream", {
        method: "POST", signal: controller.signal, credentials: "same-origin",
        headers: {"Content-Type": "application/json", "X-CSRF-Token": form.dataset.csrf},
        body: JSON.stringify({model: form.model.value, message: form.message.value,
                              max_tokens: Number(form.max_tokens.value), temperature: Number(form.temperature.value)})});
      if (res.status === 401) { location.href = "/login"; return; }
      const reader = res.body.getReader(), decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf += decoder.decode(value, {stream: true});
        let nl;
        while ((nl = buf.indexOf("\n")) >= 0) {
          const line = buf.slice(0, nl); buf = buf.slice(nl + 1);
          if (!line.trim()) continue;
          const ev = JSON.parse(line);
          if (ev.text !== undefined) answer.textContent += ev.text;
          if (ev.error) { err.textContent = ev.error; err.hidden = false; }
          if (ev.done) {
            set("s-route", ev.route ? (routeLabels[ev.route] || ev.route) + " (" + ev.route + ")" + (ev.reason ? " — " + ev.reason : "") : "—");
            set("s-ttft", ev.ttft_ms == null ? "—" : ev.ttft_ms.toFixed(0) + " ms");
            set("s-tps", ev.tokens_per_s == null ? "—" : ev.tokens_per_s.toFixed(1));
            set("s-bytes", ev.bytes_label);
            set("s-tokens", ev.prompt_tokens + " → " + ev.output_tokens);
          }
        }
      }
    } catch (e) {
      if (e.name !== "AbortError") { err.textContent = String(e); err.hidden = false; }
    } finally {
      send.disabled = false; stop.hidden = true; controller = null;
    }
  });
})();
