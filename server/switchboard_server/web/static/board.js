// Shows every <time data-local> in the viewer's own zone (the server renders
// UTC, which stays as the fallback without scripts), and names that zone.
// Elements with data-refresh="<url>" are replaced every data-refresh-seconds
// by that URL's fragment (the same markup the page was rendered with); the
// refresh stops when the session ends. Tables of a select-many form get a
// "select all on this page" box. Without scripts the page stays as loaded.
(function () {
  "use strict";
  var zone = Intl.DateTimeFormat().resolvedOptions().timeZone || "UTC";
  var format = new Intl.DateTimeFormat("en-US", {
    year: "numeric", month: "2-digit", day: "2-digit",
    hour: "2-digit", minute: "2-digit", hourCycle: "h23", timeZoneName: "short"
  });
  function local(date) {
    var p = {};
    format.formatToParts(date).forEach(function (part) { p[part.type] = part.value; });
    return p.year + "-" + p.month + "-" + p.day + " " + p.hour + ":" + p.minute + " " + p.timeZoneName;
  }
  function run() {
    document.querySelectorAll("time[data-local]").forEach(function (el) {
      var date = new Date(el.getAttribute("datetime"));
      if (isNaN(date.getTime())) { return; }
      var text = local(date);
      if (el.getAttribute("data-local") === "labelled") { text += " (your time, " + zone + ")"; }
      el.textContent = text;
      el.title = el.getAttribute("datetime");
    });
    document.querySelectorAll("[data-zone-name]").forEach(function (el) { el.textContent = zone; });
  }
  function refresh(el) {
    var url = el.getAttribute("data-refresh");
    var seconds = parseFloat(el.getAttribute("data-refresh-seconds")) || 10;
    var timer = window.setInterval(function () {
      if (document.visibilityState === "hidden") { return; }
      fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } })
        .then(function (response) {
          if (!response.ok || response.redirected) {  // signed out, or gone: stop
            window.clearInterval(timer);
            return null;
          }
          return response.text();
        })
        .then(function (html) {
          if (html === null) { return; }
          el.innerHTML = html;
          el.setAttribute("data-refreshed", String(Date.now()));
          run();
        })
        .catch(function () { /* offline for a moment: try again at the next tick */ });
    }, seconds * 1000);
  }
  function selectAll(form) {
    var head = form.querySelector("thead th.pick");
    if (!head) { return; }
    var box = document.createElement("input");
    box.type = "checkbox";
    box.className = "pick-all";
    box.setAttribute("aria-label", "Select every todo on this page");
    box.addEventListener("change", function () {
      form.querySelectorAll("tbody input[type=checkbox][name=todo]").forEach(function (b) {
        b.checked = box.checked;
      });
    });
    head.textContent = "";
    head.appendChild(box);
  }
  function start() {
    run();
    document.querySelectorAll("[data-refresh]").forEach(refresh);
    document.querySelectorAll("form.select-many").forEach(selectAll);
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
