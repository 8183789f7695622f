// The campaign page's path chart: one bar per decided candidate (gain over its round's
// incumbent, %), its interval as whiskers, coloured by outcome (Chart.js + error bars, vendored).
"use strict";
(function () {
  Chart.register(ChartErrorBars.BarWithErrorBarsController, ChartErrorBars.BarWithErrorBar);
  const doc = JSON.parse(document.getElementById("chart-data").textContent);
  const canvas = document.getElementById("path-chart");
  if (!canvas || !doc.bars.length) return;
  const COLORS = { adopted: "#1a7f37", inert: "#8c959f", worse: "#cf222e" };
  const bars = doc.bars;
  const sign = (v) => (v >= 0 ? "+" : "") + v.toFixed(1) + " %";
  new Chart(canvas, {
    type: "barWithErrorBars",
    data: {
      labels: bars.map((b) => b.label),
      datasets: [{
        label: "gain over the incumbent (%)",
        data: bars.map((b) => ({ y: b.y, yMin: b.low, yMax: b.high })),
        backgroundColor: bars.map((b) => COLORS[b.outcome] || "#bf8700"),
        errorBarColor: "#1f2328",
        errorBarWhiskerColor: "#1f2328",
        errorBarWhiskerRatio: 0.4,
        errorBarLineWidth: 1.2,
        maxBarThickness: 48,
      }],
    },
    options: {
      responsive: true,
      maintainAspectRatio: false,
      animation: false,
      scales: {
        x: { title: { display: true, text: "round, variable, from → to" }, ticks: { maxRotation: 30 } },
        y: { title: { display: true, text: "gain over the incumbent (%)" }, ticks: { callback: (v) => sign(v) } },
      },
      plugins: {
        legend: { display: false },
        tooltip: {
          callbacks: {
            label(item) {
              const b = bars[item.dataIndex];
              return `${b.outcome}: ${b.text}`;
            },
          },
        },
      },
    },
  });
})();
