// Shows every <time data-local> in the viewer's own zone (the server renders
// UTC, which stays as the fallback without scripts), and names that zone.
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
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", run);
  } else {
    run();
  }
})();
