// Loaded between require.js and html-manager's embed-amd.js on pages with widgets.
// 1. html-manager asks requirejs for a widget's module first and falls back to a CDN only
//    when that fails: anywidget (plotly>=6 FigureWidget) maps to its copy in _static.
// 2. The modules bundled in embed-amd.js each take their requirejs URL's folder as the
//    place of their assets (FontAwesome 4 fonts, for widget icons); unmapped, that is
//    the page's own folder. Mapping every one of them to _static/jupyter-widgets/ puts the
//    fonts there, whichever module injects the CSS first.
// 3. html-manager 1.x typesets widget labels with MathJax 2's MathJax.Hub.Queue; Sphinx
//    loads MathJax 3, which has no Hub: every label then throws a TypeError. A small Hub
//    that hands the element to MathJax 3 goes in before the widgets render (on "load").
(function () {
  var here = document.currentScript.src.replace(/[^/]*$/, "") + "jupyter-widgets/";
  var paths = { anywidget: here + "anywidget" };
  ["@jupyter-widgets/base", "@jupyter-widgets/base7", "@jupyter-widgets/controls",
   "@jupyter-widgets/controls7", "@jupyter-widgets/html-manager",
   "@jupyter-widgets/html-manager/dist/libembed-amd"].forEach(function (name) {
    paths[name] = here + name.replace(/^.*\//, "");
  });
  window.requirejs.config({ paths: paths });

  window.addEventListener("load", function () {
    var mj = window.MathJax;
    if (mj && !mj.Hub) {
      mj.Hub = {
        Queue: function (job) {
          var el = job && job[2];
          if (el && mj.typesetPromise) mj.typesetPromise([el]);
        },
      };
    }
  });
})();
