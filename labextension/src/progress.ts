/**
 * The notification that follows a save or a restore.
 *
 * Progress changes it in place; the outcome replaces it with a new notification.
 * JupyterLab hands an update to the toast only once the toast is on screen, so an
 * outcome sent as an update (a refusal within milliseconds, or a success right after a
 * progress update) was lost: the toast stayed at its progress text and never closed.
 * And an update sent before the toast is on screen makes JupyterLab create the toast
 * again, later: after the outcome dismissed it, a stale progress toast came back. So
 * progress waits until the toast is shown.
 */
import { Notification } from '@jupyterlab/apputils';

export class JobNotification {
  constructor(message: string) {
    this._id = Notification.emit(message, 'in-progress', { autoClose: false });
  }

  /**
   * Whether JupyterLab shows the toast ``id`` (react-toastify gives its element that id).
   * Replaced by unit tests, which have no toasts on screen.
   */
  static isShown = (id: string): boolean => document.getElementById(id) !== null;

  /** How long the progress toast outlives the outcome; unit tests set 0. */
  static settleMs = 300;

  /** The job's phase and, once known, how far it is; skipped until the toast shows. */
  progress(message: string, progress?: number): void {
    if (!JobNotification.isShown(this._id)) {
      return;
    }
    Notification.update({
      id: this._id,
      type: 'in-progress',
      message,
      progress,
      autoClose: false
    });
  }

  /**
   * Show the outcome. ``actions`` receives the function that closes the outcome's
   * notification, for an action that must close it (Details keeps it open).
   */
  finish(
    type: 'success' | 'warning' | 'error',
    message: string,
    options: {
      autoClose: number | false;
      actions?: (dismiss: () => void) => Notification.IAction[];
    }
  ): void {
    this._dismissProgress();
    const dismiss = () => Notification.dismiss(this._id);
    this._id = Notification.emit(message, type, {
      autoClose: options.autoClose,
      actions: options.actions?.(dismiss)
    });
  }

  /** Close the toast without an outcome: another notification takes over. */
  close(): void {
    this._dismissProgress();
  }

  /**
   * Dismiss the progress toast once it has settled. react-toastify applies an update two
   * timer turns after it is asked for, a dismiss one turn after: dismissed at once, a
   * toast updated just before came back.
   */
  private _dismissProgress(): void {
    const progressToast = this._id;
    if (JobNotification.settleMs > 0) {
      window.setTimeout(
        () => Notification.dismiss(progressToast),
        JobNotification.settleMs
      );
    } else {
      Notification.dismiss(progressToast);
    }
  }

  private _id: string;
}
