/**
 * What the UI knows about each kernel's snapshots, and the save and restore actions.
 *
 * The toolbar button, the status bar item and the commands all read the same state from
 * here, so a snapshot started from one of them shows in all.
 */
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import type { NotebookPanel } from '@jupyterlab/notebook';
import type { ServiceManager } from '@jupyterlab/services';
import type { TranslationBundle } from '@jupyterlab/translation';
import { ISignal, Signal } from '@lumino/signaling';
import {
  AutosaveOverride,
  FallbackMode,
  IAutosaveState,
  IFallbackReport,
  IJob,
  IJobError,
  IKernelStatus,
  IRestoreResult,
  ISnapshotSummary,
  SNAPSHOT_KERNEL_NAME,
  SnapshotAPI,
  SnapshotAPIError
} from './api';
import {
  describeProgress,
  describeSaved,
  estimateSecondsLeft,
  formatAge,
  formatBytes,
  formatSeconds,
  toastProgress
} from './format';
import {
  askFallback,
  fallbackLabel,
  offeredFallbacks,
  showFallbackReport,
  summarizeReport
} from './fallback';
import { JobFollower } from './jobs';
import { overallFraction } from './phases';
import { JobNotification } from './progress';
import { heldByRunningKernel, portsHolder } from './remedy';
import { markRestorePoint } from './restorepoint';
import { untranslated } from './translation';
import { rebindWidgets } from './widgets';

/** How long a success notification stays up. */
export const SUCCESS_CLOSE_MS = 6000;

/** The step and the cause (toasts cut long text; the log path is in the details). */
export function shortError(error: IJobError | null, trans = untranslated): string {
  if (!error) {
    return trans.__('the job ended without a result');
  }
  if (!error.step || !error.cause) {
    return error.message;
  }
  // A refusal (a bad name, a busy or unready kernel, taken ports, another node's image)
  // is no failed step: say what was wrong, in the server's words.
  const refused = error.code !== undefined && error.code !== 'failed';
  const text = refused ? error.cause : trans.__('%1 failed: %2', error.step, error.cause);
  return error.hint
    ? trans.__('%1. %2', text, error.hint[0].toUpperCase() + error.hint.slice(1))
    : text;
}

/** What a failed restore offers to do about it, e.g. shut down the kernel holding its ports. */
export interface IRemedy {
  label: string;
  caption: string;
  run: () => void;
}

/**
 * A "Details" button showing the whole message, the hint and the kept log. It leaves the
 * notification open, and the dialog offers the remedy too, so neither gets lost.
 */
function detailsAction(
  title: string,
  error: IJobError | null,
  remedy: IRemedy | null,
  dismiss: () => void,
  trans: TranslationBundle
): Notification.IAction[] {
  if (!error) {
    return [];
  }
  const lines = [error.message];
  if (error.log && !error.message.includes(error.log)) {
    lines.push(trans.__('Log: %1', error.log));
  }
  return [
    {
      label: trans.__('Details'),
      caption: trans.__('Show the whole error and where its log is'),
      callback: event => {
        event.preventDefault();
        void showDialog({
          title,
          body: lines.join('\n'),
          buttons: [
            Dialog.cancelButton({ label: trans.__('Close') }),
            ...(remedy
              ? [Dialog.warnButton({ label: remedy.label, caption: remedy.caption })]
              : [])
          ]
        }).then(result => {
          if (remedy && result.button.accept) {
            dismiss();
            remedy.run();
          }
        });
      }
    }
  ];
}

export interface IRestoreOptions {
  /**
   * When the notebook's own kernel holds the snapshot's ports, shut it down and restore,
   * instead of offering to. For a kernel that replaced a dead one: it holds nothing to keep.
   */
  replaceOwnKernel?: boolean;
  /**
   * Start a fresh kernel and bring back what the snapshot kept besides its image (its
   * portable copy, its recorded cells, or both) instead of restoring the image.
   */
  fallback?: FallbackMode;
}

/** What a failed restore offers instead of its image, filled in when it fails. */
interface IFallbackOffer {
  modes: FallbackMode[];
  /** What failed, in a line, for the dialog. */
  failure: string | null;
  /** Closes the failure's notification: a way back was taken. */
  dismiss: () => void;
  /** The dialog is open: its notification's action must not open a second one. */
  asking: boolean;
}

export { SNAPSHOT_KERNEL_NAME };
export const SNAPSHOT_KERNEL_DISPLAY_NAME = 'Python 3 (snapshots)';

interface IKernelEntry {
  status: IKernelStatus | null;
  error: string | null;
  job: IJob | null;
  /** Null from servers without autosave, or before the first answer. */
  autosave: IAutosaveState | null;
  /** The server's last answer was that it knows no such kernel (404). */
  gone: boolean;
  /**
   * How many times a job that ended here changed the status: an answer to a request sent
   * before the last is older than what the page knows (a snapshot committed since), and
   * is dropped.
   */
  settled: number;
}

export interface IAvailability {
  enabled: boolean;
  /** Why the action is (not) available, for tooltips. */
  reason: string;
  /** Whether switching the notebook's kernel makes it available. */
  changeKernel?: boolean;
}

/** Where a user reads which kernels can be saved and how to switch. */
export const HELP_URL = 'https://jupyterlab.readthedocs.io/en/stable/user/notebook.html';

export class SnapshotController {
  /**
   * ``trans`` words every message the controller shows, and the widgets that read its
   * state use the same bundle; without one it speaks English.
   */
  constructor(
    readonly api: SnapshotAPI,
    private readonly _services: ServiceManager.IManager,
    readonly trans: TranslationBundle = untranslated
  ) {
    this._follower = new JobFollower(api, _services.events ?? null);
    // A job started elsewhere (the magic, the widget, another browser) still shows here.
    this._follower.jobEvent = job => this._onForeignJob(job);
  }

  /** Milliseconds between polls of a running job when the event stream is silent. */
  set followInterval(ms: number) {
    this._follower.interval = ms;
  }

  /** Emitted with the kernel id whose state changed. */
  get changed(): ISignal<this, string> {
    return this._changed;
  }

  kernelId(panel: NotebookPanel | null): string | null {
    return panel?.sessionContext.session?.kernel?.id ?? null;
  }

  entry(kernelId: string | null): IKernelEntry | null {
    return kernelId ? (this._entries.get(kernelId) ?? null) : null;
  }

  /**
   * Override the autosave policy of the kernel's notebook (PUT kernels/{id}/autosave);
   * called by the sidebar. Resolves to the new state; throws SnapshotAPIError.
   */
  async setAutosave(
    kernelId: string,
    override: AutosaveOverride
  ): Promise<IAutosaveState> {
    const state = await this.api.setAutosave(kernelId, override);
    this._entry(kernelId).autosave = state;
    this._changed.emit(kernelId);
    return state;
  }

  /**
   * Whether the server no longer knows the kernel, or is about to retire it: a remedy shut
   * it down, a restore replaces it, or its last answer said so (404). Polls leave it
   * alone, the notebook moves on to its next kernel; a kernel the server answered 404 for
   * is still asked about when its notebook's kernel shows signs of life (a restarted
   * server adopts the kernels a killed one left, under their ids).
   */
  gone(kernelId: string): boolean {
    return (
      this._shutDown.has(kernelId) ||
      this._replaced.has(kernelId) ||
      (this._entries.get(kernelId)?.gone ?? false)
    );
  }

  /**
   * The notebook's kernel, for a poll to ask the server about: none while the notebook's
   * session shuts down (Kernel › Shut Down), nor once the kernel is gone.
   */
  polledKernel(panel: NotebookPanel | null): string | null {
    const kernelId = this.kernelId(panel);
    if (!kernelId || panel?.sessionContext.isTerminating || this.gone(kernelId)) {
      return null;
    }
    return kernelId;
  }

  /** Ask the server again whether this kernel can be snapshotted. */
  refresh(kernelId: string): Promise<void> {
    if (this._shutDown.has(kernelId) || this._replaced.has(kernelId)) {
      return Promise.resolve(); // the server no longer knows it, or soon: it would answer 404
    }
    // Several widgets watch the same kernel: one request at a time, plus one more when
    // asked again meanwhile (the state may have changed since the first was sent).
    const running = this._refreshing.get(kernelId);
    if (running) {
      this._refreshAgain.add(kernelId);
      return running;
    }
    const next = this._fetchStatus(kernelId).finally(() => {
      this._refreshing.delete(kernelId);
      if (this._refreshAgain.delete(kernelId)) {
        void this.refresh(kernelId);
      }
    });
    this._refreshing.set(kernelId, next);
    return next;
  }

  private async _fetchStatus(kernelId: string): Promise<void> {
    const entry = this._entry(kernelId);
    const settled = entry.settled;
    try {
      const [status, autosave] = await Promise.all([
        this.api.kernelStatus(kernelId),
        this.api.autosave(kernelId).catch(() => null)
      ]);
      if (entry.settled !== settled) {
        // Asked before a job ended here: it would show the kernel as it was ("No
        // snapshot yet" after a save). Asked again instead.
        this._refreshAgain.add(kernelId);
        return;
      }
      entry.status = status;
      entry.autosave = autosave;
      entry.error = null;
      entry.gone = false;
      if (status.job?.status === 'running' && !this._followed.has(status.job.id)) {
        void this._followQuietly(kernelId, status.job);
      }
    } catch (error) {
      // A kernel the server does not know (any more) is no failure to show.
      entry.gone = error instanceof SnapshotAPIError && error.error?.code === 'not_found';
      entry.status = null;
      entry.error = entry.gone ? null : (error as Error).message;
    }
    this._changed.emit(kernelId);
  }

  /** The save or restore job running for this notebook, if any. */
  activeJob(panel: NotebookPanel | null): IJob | null {
    if (!panel) {
      return null;
    }
    const restoring = this._restores.get(panel.context.path);
    if (restoring) {
      return restoring;
    }
    const job = this.entry(this.kernelId(panel))?.job;
    return job?.status === 'running' ? job : null;
  }

  saveAvailability(panel: NotebookPanel | null): IAvailability {
    const trans = this.trans;
    const kernelId = this.kernelId(panel);
    if (!kernelId) {
      return {
        enabled: false,
        reason: trans.__('No kernel is running in this notebook')
      };
    }
    const entry = this.entry(kernelId);
    const job = this.activeJob(panel);
    if (job) {
      const progress = describeProgress(job, undefined, trans);
      return {
        enabled: false,
        reason:
          job.kind === 'save'
            ? trans.__('A snapshot of this kernel is running: %1', progress)
            : trans.__('A restore of this kernel is running: %1', progress)
      };
    }
    if (entry?.error) {
      return {
        enabled: false,
        reason: trans.__('Cannot snapshot: the server did not answer (%1)', entry.error)
      };
    }
    if (!entry?.status) {
      return {
        enabled: false,
        reason: trans.__('Checking whether this kernel can be snapshotted…')
      };
    }
    if (!entry.status.ready) {
      const details = entry.status.reasons.join('; ');
      if (entry.status.kernel_name !== SNAPSHOT_KERNEL_NAME) {
        // The usual case, in a user's words; the server's findings are in the docs' terms.
        return {
          enabled: false,
          reason: trans.__(
            "Snapshots unavailable: this notebook runs a kernel that cannot be saved. Switch to the '%1' kernel with Kernel › Change Kernel… (click for help)",
            SNAPSHOT_KERNEL_DISPLAY_NAME
          ),
          changeKernel: true
        };
      }
      return {
        enabled: false,
        reason: trans.__(
          'Snapshots unavailable: %1',
          details || trans.__('the server says this kernel is not snapshot-ready')
        )
      };
    }
    return {
      enabled: true,
      reason: trans.__(
        "Snapshot kernel: save this kernel's memory (variables, GPU tensors) to disk"
      )
    };
  }

  /** Called when the greyed-out button is clicked: say why, and offer the way out. */
  explainUnavailable(panel: NotebookPanel): void {
    const availability = this.saveAvailability(panel);
    if (availability.enabled) {
      return;
    }
    const trans = this.trans;
    const actions: Notification.IAction[] = [];
    if (availability.changeKernel && this.changeKernel) {
      const change = this.changeKernel;
      actions.push({
        label: trans.__('Change kernel…'),
        caption: trans.__("Pick '%1' in the dialog", SNAPSHOT_KERNEL_DISPLAY_NAME),
        displayType: 'accent',
        callback: () => change(panel)
      });
      actions.push({
        label: trans.__('Why?'),
        caption: trans.__('How snapshots work, and which kernels they need'),
        callback: () => window.open(HELP_URL, '_blank', 'noopener')
      });
    }
    // Under JupyterLab's 140 characters a notification shows.
    const text = availability.changeKernel
      ? trans.__(
          "Snapshots need the '%1' kernel. Switch this notebook to it (its variables start afresh).",
          SNAPSHOT_KERNEL_DISPLAY_NAME
        )
      : availability.reason;
    Notification.info(text, { autoClose: 10000, actions });
  }

  /** Set by the plugin: opens JupyterLab's kernel picker for a notebook. */
  changeKernel: ((panel: NotebookPanel) => void) | null = null;

  /**
   * Snapshot the notebook's kernel, with a notification that follows the job. With
   * ``portable``, the snapshot also keeps a portable copy of the kernel's variables, which
   * a fresh kernel can load if the image cannot come back.
   */
  async save(
    panel: NotebookPanel,
    name?: string,
    options: { portable?: boolean } = {}
  ): Promise<ISnapshotSummary | null> {
    const kernelId = this.kernelId(panel);
    const availability = this.saveAvailability(panel);
    if (!kernelId || !availability.enabled) {
      Notification.warning(availability.reason, { autoClose: 5000 });
      return null;
    }
    const trans = this.trans;
    const notebook = panel.context.localPath;
    const toast = new JobNotification(trans.__('Snapshot of %1: starting…', notebook));
    let job: IJob;
    try {
      // Only what was asked for: a server without portable copies refuses the field.
      job = await this.api.startSave(kernelId, {
        ...(name ? { name } : {}),
        ...(options.portable ? { portable: true } : {})
      });
    } catch (error) {
      const apiError = error instanceof SnapshotAPIError ? error.error : null;
      toast.finish(
        'error',
        trans.__(
          'Snapshot failed: %1',
          apiError ? shortError(apiError, trans) : (error as Error).message
        ),
        { autoClose: false }
      );
      void this.refresh(kernelId);
      return null;
    }
    const final = await this._follow(kernelId, job, current =>
      toast.progress(
        trans.__('Snapshot of %1: %2', notebook, this.describeJob(current)),
        toastProgress(this.progressOf(current))
      )
    );
    if (final.status === 'succeeded' && final.result) {
      const summary = final.result as ISnapshotSummary;
      // Shown at once: waiting for the status would flash "no snapshot yet" meanwhile.
      const status = this.entry(kernelId)?.status;
      if (status) {
        status.last_snapshot = summary;
        this._entry(kernelId).settled++;
        this._changed.emit(kernelId);
      }
      void this.refresh(kernelId);
      toast.finish('success', describeSaved(summary, trans), {
        autoClose: SUCCESS_CLOSE_MS
      });
      return summary;
    }
    void this.refresh(kernelId);
    toast.finish(
      'error',
      trans.__('Snapshot failed: %1', shortError(final.error, trans)),
      {
        autoClose: false,
        actions: dismiss =>
          detailsAction(trans.__('Snapshot failed'), final.error, null, dismiss, trans)
      }
    );
    return null;
  }

  /** A running job's phase, bytes and, once the rate is known, the time left. */
  describeJob(job: IJob): string {
    const fraction = this.progressOf(job);
    const bar = this._bars.get(job.id);
    const elapsed = bar ? (Date.now() - bar.since) / 1000 : 0;
    return describeProgress(job, estimateSecondsLeft(fraction, elapsed), this.trans);
  }

  /**
   * How far the whole job is, in [0, 1], never less than it was shown before (the
   * phases' shares are the kernel's last save's, ``phases.overallFraction``); undefined
   * until some phase has a size.
   */
  progressOf(job: IJob): number | undefined {
    let bar = this._bars.get(job.id);
    if (!bar) {
      const timings =
        job.kind === 'save' && job.kernel_id
          ? (this.entry(job.kernel_id)?.status?.last_snapshot?.timings ?? null)
          : null;
      bar = { since: Date.now(), seen: new Set(), furthest: undefined, timings };
      this._bars.set(job.id, bar);
    }
    bar.seen.add(job.phase);
    if (job.total > 0 || bar.furthest !== undefined) {
      const now = overallFraction(job, bar.seen, bar.timings);
      bar.furthest = Math.max(bar.furthest ?? 0, now);
    }
    return bar.furthest;
  }

  /** The snapshot each kernel restored here came from (kernel id to snapshot id). */
  originOf(kernelId: string | null): string | null {
    return kernelId ? (this._origins.get(kernelId) ?? null) : null;
  }

  /**
   * What to offer when a restore is refused because its ports are taken: shut down the
   * kernel that holds them (the server names it), whichever notebook it belongs to.
   */
  portsRemedy(
    panel: NotebookPanel,
    snapshot: ISnapshotSummary,
    error: IJobError | null
  ): { message: string; remedy: IRemedy | null } | null {
    const trans = this.trans;
    const holder = portsHolder(error, this.kernelId(panel), trans);
    if (holder === null) {
      return null;
    }
    if (holder.kind === 'outside') {
      return {
        message: trans.__(
          'its ports are taken by a process this server does not run (another restore of it from the command line?); stop that process first'
        ),
        remedy: null
      };
    }
    if (holder.kind === 'this-kernel') {
      return {
        message: trans.__("its ports are taken by this notebook's own kernel"),
        remedy: {
          label: trans.__('Shut down this kernel and restore'),
          caption: trans.__(
            "Shut down this notebook's kernel (its current state is lost), then restore"
          ),
          run: () => void this._restoreReplacing(panel, snapshot, null)
        }
      };
    }
    const { owner, kernelId } = holder;
    return {
      message: trans.__('its ports are taken by the kernel of %1', owner),
      remedy: {
        label: trans.__("Shut down %1's kernel and restore", owner),
        caption: trans.__(
          'Shut down the kernel of %1 (its current state is lost), then restore here; this notebook keeps its kernel until the restore replaces it',
          holder.path ?? kernelId
        ),
        run: () => void this._restoreReplacing(panel, snapshot, kernelId)
      }
    };
  }

  /**
   * Restore a snapshot into this notebook: the server starts the restored kernel and
   * the notebook's session is switched to it. When the image cannot come back and the
   * snapshot offers another way (``error.details.fallback``), a dialog offers it; with
   * ``options.fallback`` that way is taken at once, into a fresh kernel.
   */
  async restore(
    panel: NotebookPanel,
    snapshot: ISnapshotSummary,
    options: IRestoreOptions = {}
  ): Promise<boolean> {
    const offer: IFallbackOffer = {
      modes: [],
      failure: null,
      dismiss: () => undefined,
      asking: false
    };
    const restored = await this._restoreOnce(panel, snapshot, options, offer);
    if (restored || !offer.modes.length || panel.isDisposed) {
      return restored;
    }
    // Asked once the restore is over: the notebook's kernel is its own again meanwhile.
    return this._offerFallback(panel, snapshot, offer, options);
  }

  /** The dialog offering the ways back; the chosen one is restored. */
  private async _offerFallback(
    panel: NotebookPanel,
    snapshot: ISnapshotSummary,
    offer: IFallbackOffer,
    options: IRestoreOptions
  ): Promise<boolean> {
    if (offer.asking) {
      return false;
    }
    offer.asking = true;
    let mode: FallbackMode | null;
    try {
      mode = await askFallback(snapshot, offer.modes, offer.failure, this.trans);
    } finally {
      offer.asking = false;
    }
    if (!mode || panel.isDisposed) {
      return false; // the failure's notification stays, and offers the dialog again
    }
    offer.dismiss();
    return this.restore(panel, snapshot, { ...options, fallback: mode });
  }

  private async _restoreOnce(
    panel: NotebookPanel,
    snapshot: ISnapshotSummary,
    options: IRestoreOptions,
    offer: IFallbackOffer
  ): Promise<boolean> {
    // The server retires the session's kernel once the restored one takes its place: no
    // status request may ask about it until the notebook has switched, or it gets 404.
    const replaced = panel.sessionContext.session ? this.kernelId(panel) : null;
    if (!replaced || this._replaced.has(replaced)) {
      return this._restore(panel, snapshot, options, offer);
    }
    this._replaced.add(replaced);
    try {
      await this._refreshing.get(replaced);
      return await this._restore(panel, snapshot, options, offer);
    } finally {
      this._replaced.delete(replaced);
    }
  }

  private async _restore(
    panel: NotebookPanel,
    snapshot: ISnapshotSummary,
    options: IRestoreOptions,
    offer: IFallbackOffer
  ): Promise<boolean> {
    const trans = this.trans;
    const sessionContext = panel.sessionContext;
    const fallback = options.fallback ?? null;
    const toast = new JobNotification(
      fallback
        ? trans.__(
            "Restoring '%1' into a fresh kernel (%2)…",
            snapshot.name,
            fallbackLabel(fallback, trans).toLowerCase()
          )
        : trans.__("Restoring '%1'…", snapshot.name)
    );
    // Set when a refusal for this notebook's own ports turns into the remedy.
    const replaced: { restore: Promise<boolean> | null } = { restore: null };
    const fail = (message: string, error: IJobError | null = null): boolean => {
      const ports = this.portsRemedy(panel, snapshot, error);
      const remedy = ports?.remedy ?? null;
      if (
        options.replaceOwnKernel &&
        portsHolder(error, this.kernelId(panel))?.kind === 'this-kernel'
      ) {
        // The notebook's own kernel holds the ports: the remedy is what was asked for.
        toast.close();
        replaced.restore = this._restoreReplacing(panel, snapshot, null);
        return false;
      }
      // A way back into a fresh kernel, when the image cannot come back; not for taken
      // ports (freeing them lets the image come back), nor again by a restore that took
      // one.
      const modes = ports || fallback ? [] : offeredFallbacks(error?.details?.fallback);
      const text = fallback
        ? trans.__(
            "Restore of '%1' into a fresh kernel failed: %2",
            snapshot.name,
            message
          )
        : trans.__(
            "Restore of '%1' failed: %2",
            snapshot.name,
            ports?.message ?? message
          );
      if (modes.length) {
        offer.modes = modes;
        offer.failure = ports?.message ?? message; // the dialog's title names the restore
      }
      toast.finish('error', text, {
        autoClose: false,
        actions: dismiss => {
          offer.dismiss = dismiss;
          return [
            ...(modes.length
              ? [
                  {
                    label: trans.__('Restore another way…'),
                    caption: trans.__(
                      'Start a fresh kernel with what the snapshot kept besides its image'
                    ),
                    displayType: 'accent' as const,
                    callback: () =>
                      void this._offerFallback(panel, snapshot, offer, options)
                  }
                ]
              : []),
            ...(remedy
              ? [
                  {
                    label: remedy.label,
                    caption: remedy.caption,
                    displayType: 'accent' as const,
                    callback: remedy.run
                  }
                ]
              : []),
            ...detailsAction(
              fallback
                ? trans.__("Restore of '%1' into a fresh kernel failed", snapshot.name)
                : trans.__("Restore of '%1' failed", snapshot.name),
              error,
              remedy,
              dismiss,
              trans
            )
          ];
        }
      });
      return false;
    };
    const started = Date.now();
    let job: IJob;
    try {
      // With a session, the server moves it to the restored kernel. Without one, the
      // notebook makes its own session below: JupyterLab cannot adopt a session that the
      // server would create for the path, and a second one for the same path would follow.
      const sessionId = sessionContext.session?.id;
      job = await this.api.startRestore(snapshot.id, {
        ...(sessionId ? { path: sessionContext.path, session_id: sessionId } : {}),
        ...(fallback ? { fallback } : {})
      });
    } catch (error) {
      const apiError = error instanceof SnapshotAPIError ? error.error : null;
      fail(apiError ? shortError(apiError, trans) : (error as Error).message, apiError);
      return replaced.restore ?? false;
    }
    const path = panel.context.path;
    const final = await this._follow(null, job, current => {
      this._restores.set(path, current);
      this._changed.emit('');
      toast.progress(
        fallback
          ? trans.__(
              "Restoring '%1' into a fresh kernel: %2",
              snapshot.name,
              this.describeJob(current)
            )
          : trans.__("Restoring '%1': %2", snapshot.name, this.describeJob(current)),
        toastProgress(this.progressOf(current))
      );
    });
    this._restores.delete(path);
    this._changed.emit('');
    if (final.status !== 'succeeded' || !final.result) {
      fail(shortError(final.error, trans), final.error);
      return replaced.restore ?? false;
    }
    const result = final.result as IRestoreResult;
    if (!fallback) {
      // A fresh kernel holds none of the snapshot's ports: it is no origin.
      this._origins.set(result.kernel_id, snapshot.id);
    }
    try {
      await this._attach(panel, result);
    } catch (error) {
      return fail(
        trans.__(
          'the kernel was restored (id %1) but the notebook could not switch to it: %2',
          result.kernel_id,
          (error as Error).message
        )
      );
    }
    void this.refresh(result.kernel_id);
    if (!fallback) {
      markRestorePoint(
        panel,
        snapshot.execution_count,
        snapshot.execution_count
          ? trans.__(
              "The kernel went back to here: '%1', after In [%2]",
              snapshot.name,
              snapshot.execution_count
            )
          : trans.__("The kernel went back to here: '%1'", snapshot.name)
      );
    }
    void rebindWidgets(panel).catch(error =>
      console.warn(
        'jupyter-gpu-snapshot: widgets of the restored kernel not shown',
        error
      )
    );
    const seconds = (Date.now() - started) / 1000;
    if (fallback) {
      this._finishFallback(toast, snapshot, result, seconds);
      return true;
    }
    toast.finish(
      'success',
      trans.__(
        "Kernel restored from '%1' (%2) in %3",
        snapshot.name,
        formatBytes(snapshot.size_bytes, trans),
        formatSeconds(seconds, trans)
      ),
      { autoClose: SUCCESS_CLOSE_MS }
    );
    return true;
  }

  /**
   * The outcome of a fallback restore: a line in the notification (a warning that stays
   * when something did not come back), and the whole report, shown at once and again from
   * the notification.
   */
  private _finishFallback(
    toast: JobNotification,
    snapshot: ISnapshotSummary,
    result: IRestoreResult,
    seconds: number
  ): void {
    const trans = this.trans;
    const report = result.fallback;
    if (!report) {
      toast.finish(
        'success',
        trans.__(
          "A fresh kernel took the place of '%1' in %2",
          snapshot.name,
          formatSeconds(seconds, trans)
        ),
        { autoClose: SUCCESS_CLOSE_MS }
      );
      return;
    }
    const incomplete =
      (report.not_loaded ?? []).length > 0 ||
      (report.replayed ?? []).some(cell => cell.status !== 'ok');
    const show = () => void showFallbackReport(snapshot.name, report, trans);
    toast.finish(
      incomplete ? 'warning' : 'success',
      trans.__(
        "A fresh kernel took the place of '%1' in %2: %3",
        snapshot.name,
        formatSeconds(seconds, trans),
        summarizeReport(report, trans)
      ),
      {
        autoClose: incomplete ? false : SUCCESS_CLOSE_MS,
        actions: () => [
          {
            label: trans.__('Report'),
            caption: trans.__('What came back, what did not and why, the cells re-run'),
            callback: event => {
              event.preventDefault();
              show();
            }
          }
        ]
      }
    );
    show();
  }

  /**
   * Restore ``snapshot`` as the user asked for it (the restore dialog, the sidebar). One
   * whose ports the notebook's running kernel holds (``remedy.heldByRunningKernel``;
   * ``listing`` is what the asker listed) means going back in that kernel's own history:
   * restoring it replaces the kernel, so the user is asked once, then it is done, without
   * a refusal first.
   */
  async restoreAsked(
    panel: NotebookPanel,
    snapshot: ISnapshotSummary,
    options: IRestoreOptions = {},
    listing: readonly ISnapshotSummary[] = []
  ): Promise<boolean> {
    const kernelId = this.kernelId(panel);
    const running = { kernelId, originId: this.originOf(kernelId) };
    if (options.fallback || !heldByRunningKernel(snapshot, running, listing)) {
      return this.restore(panel, snapshot, options);
    }
    const trans = this.trans;
    const answer = await showDialog({
      title: trans.__("Go back to '%1'?", snapshot.name),
      body: trans.__(
        "Replace this notebook's kernel with '%1', saved %2? What the kernel did since is lost.",
        snapshot.name,
        formatAge(snapshot.created, undefined, trans)
      ),
      buttons: [
        Dialog.cancelButton(),
        Dialog.warnButton({
          label: trans.__('Replace kernel'),
          caption: trans.__(
            "Shut down this notebook's kernel and restore '%1' in its place",
            snapshot.name
          )
        })
      ]
    });
    if (!answer.button.accept || panel.isDisposed) {
      return false;
    }
    return this._restoreReplacing(panel, snapshot, null);
  }

  /**
   * Shut down the kernel holding the snapshot's ports (``holder``, or this notebook's own
   * when null), then restore. Called from the refused restore's remedy button, and for a
   * confirmed ``restoreAsked``.
   */
  private async _restoreReplacing(
    panel: NotebookPanel,
    snapshot: ISnapshotSummary,
    holder: string | null
  ): Promise<boolean> {
    if (panel.isDisposed) {
      return false;
    }
    const doomed = holder ?? this.kernelId(panel);
    if (doomed) {
      // No status request may reach the server once the kernel is gone.
      this._shutDown.add(doomed);
      await this._refreshing.get(doomed);
    }
    if (holder === null) {
      await panel.sessionContext.shutdown();
    } else {
      await this._shutdownKernel(holder);
    }
    return this.restore(panel, snapshot);
  }

  /** Shut down another notebook's kernel as its Kernel menu would: its session ends too. */
  private async _shutdownKernel(kernelId: string): Promise<void> {
    const sessions = this._services.sessions;
    await sessions.refreshRunning();
    const session = Array.from(sessions.running()).find(s => s.kernel?.id === kernelId);
    if (session) {
      await sessions.shutdown(session.id);
    } else {
      await this._services.kernels.shutdown(kernelId);
    }
  }

  /** Make the notebook's session use the restored kernel, unless the server already did. */
  private async _attach(panel: NotebookPanel, result: IRestoreResult): Promise<void> {
    const sessionContext = panel.sessionContext;
    const current = () => sessionContext.session?.kernel?.id ?? null;
    if (current() === result.kernel_id) {
      return;
    }
    // When the server moved the session, the session list carries the new kernel.
    await this._services.sessions.refreshRunning();
    if (current() === result.kernel_id) {
      return;
    }
    await sessionContext.changeKernel({ id: result.kernel_id });
    if (current() !== result.kernel_id) {
      throw new Error(
        this.trans.__(
          'the session still uses kernel %1',
          current() ?? this.trans.__('none')
        )
      );
    }
  }

  private async _follow(
    kernelId: string | null,
    job: IJob,
    onChange: (job: IJob) => void
  ): Promise<IJob> {
    const track = (current: IJob) => {
      if (kernelId) {
        this._entry(kernelId).job = current;
        this._changed.emit(kernelId);
      }
      onChange(current);
    };
    this._followed.add(job.id);
    let final: IJob;
    try {
      final = await this._follower.follow(job, track);
    } catch (error) {
      final = {
        ...job,
        status: 'failed',
        error: {
          step: job.phase,
          cause: (error as Error).message,
          message: this.trans.__('lost track of the job: %1', (error as Error).message)
        }
      };
    }
    this._followed.delete(job.id);
    this._bars.delete(job.id);
    if (kernelId) {
      const entry = this._entry(kernelId);
      entry.job = null;
      // The new snapshot shows at once, not "No snapshot yet" until the next status.
      if (
        final.kind === 'save' &&
        final.status === 'succeeded' &&
        entry.status &&
        final.result
      ) {
        entry.settled++;
        entry.status = {
          ...entry.status,
          last_snapshot: final.result as ISnapshotSummary
        };
      }
      this._changed.emit(kernelId);
    }
    return final;
  }

  private async _followQuietly(kernelId: string, job: IJob): Promise<void> {
    await this._follow(kernelId, job, () => undefined);
    await this.refresh(kernelId);
  }

  private _onForeignJob(job: IJob): void {
    if (
      job.kind === 'restore' &&
      job.status === 'succeeded' &&
      (job.result as IRestoreResult | null)?.session_id &&
      !this._followed.has(job.id)
    ) {
      // Restored elsewhere (%gpu_snapshot restore, a script) into a session that may be a
      // notebook open here: pick up its new kernel now, not at the next session poll.
      void this._services.sessions.refreshRunning();
      const result = job.result as IRestoreResult;
      if (
        result.fallback &&
        result.session_id &&
        this.showsSession?.(result.session_id)
      ) {
        // The kernel that asked for it (the panel widget's) is retired by now: its own
        // report went with it.
        void this._reportForeignFallback(job, result.fallback);
      }
      return;
    }
    const kernelId = job.kernel_id;
    if (!kernelId || !this._entries.has(kernelId) || this._followed.has(job.id)) {
      return;
    }
    if (job.status === 'running') {
      void this._followQuietly(kernelId, job);
    }
  }

  /** Set by the plugin: whether a notebook open here runs in this session. */
  showsSession: ((sessionId: string) => boolean) | null = null;

  private async _reportForeignFallback(
    job: IJob,
    report: IFallbackReport
  ): Promise<void> {
    if (this._reported.has(job.id)) {
      return;
    }
    this._reported.add(job.id);
    const trans = this.trans;
    let name = job.snapshot_id ?? '';
    if (job.snapshot_id) {
      name = await this.api
        .getSnapshot(job.snapshot_id)
        .then(summary => summary.name)
        .catch(() => name);
    }
    const incomplete =
      (report.not_loaded ?? []).length > 0 ||
      (report.replayed ?? []).some(cell => cell.status !== 'ok');
    Notification.emit(
      trans.__(
        "A fresh kernel took the place of '%1': %2",
        name,
        summarizeReport(report, trans)
      ),
      incomplete ? 'warning' : 'success',
      {
        autoClose: incomplete ? false : SUCCESS_CLOSE_MS,
        actions: [
          {
            label: trans.__('Report'),
            caption: trans.__('What came back, what did not and why, the cells re-run'),
            callback: event => {
              event.preventDefault();
              void showFallbackReport(name, report, trans);
            }
          }
        ]
      }
    );
  }

  private _entry(kernelId: string): IKernelEntry {
    let entry = this._entries.get(kernelId);
    if (!entry) {
      entry = {
        status: null,
        error: null,
        job: null,
        autosave: null,
        gone: false,
        settled: 0
      };
      this._entries.set(kernelId, entry);
    }
    return entry;
  }

  dispose(): void {
    this._follower.dispose();
  }

  private _entries = new Map<string, IKernelEntry>();
  private _origins = new Map<string, string>();
  /** Each followed job's bar: since when, the phases seen, how far it was shown. */
  private _bars = new Map<
    string,
    {
      since: number;
      seen: Set<string>;
      furthest: number | undefined;
      timings: { [phase: string]: number } | null;
    }
  >();
  private _restores = new Map<string, IJob>();
  private _followed = new Set<string>();
  /** Fallback restores started elsewhere whose report was shown here. */
  private _reported = new Set<string>();
  private _refreshing = new Map<string, Promise<void>>();
  private _refreshAgain = new Set<string>();
  /** Kernels a remedy shut down: never asked about again. */
  private _shutDown = new Set<string>();
  /** The notebooks' kernels that running restores replace: not asked about meanwhile. */
  private _replaced = new Set<string>();
  private _changed = new Signal<this, string>(this);
  private _follower: JobFollower;
}
